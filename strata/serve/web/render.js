// Markdown from a model's answer to safe DOM: marked renders it, DOMPurify sanitises it (the page's only innerHTML).
const FORBID_TAGS = ["style", "form", "input", "button", "textarea", "select", "option"];

DOMPurify.addHook("afterSanitizeAttributes", node => {
  if (node.tagName === "A") {                      // links open elsewhere, telling the target nothing
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer nofollow");
  }
});

export function renderMarkdown(el, text) {
  const html = marked.parse(text, {async: false, gfm: true});
  el.innerHTML = DOMPurify.sanitize(html, {RETURN_TRUSTED_TYPE: true, FORBID_TAGS, FORBID_ATTR: ["style"]});
}
