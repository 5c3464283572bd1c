// Server-sent events from a fetch Response: yields each event's `data:` payload parsed as JSON, until `[DONE]`.
export async function* sseEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  try {
    for (;;) {
      const {value, done} = await reader.read();
      if (done) return;
      buf += value;
      let end;
      while ((end = /\r\n\r\n|\n\n|\r\r/.exec(buf))) {
        const block = buf.slice(0, end.index);
        buf = buf.slice(end.index + end[0].length);
        const data = block.split(/\r\n|\n|\r/).filter(l => l.startsWith("data:"))
          .map(l => l.slice(5).replace(/^ /, "")).join("\n");
        if (!data) continue;              // a comment or an event without data
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}
