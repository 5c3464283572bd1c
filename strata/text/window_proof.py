"""WindowSplit: the proof, from a chat template's jinja AST, that each message's output depends only on itself, a fixed
window of neighbours and state set before the loop over the messages (Qwen's look-back for the last user query, tool
results grouped with their neighbours); the template cut at that loop."""
from __future__ import annotations

from dataclasses import dataclass

import jinja2
import jinja2.nodes as nodes
import jinja2.utils

from strata.text.chat_chunks import _LOOP_ATTRS, _MARK, _UNSTABLE, _messages_loop

__all__ = ["WindowSplit", "split_window"]

_COMPARE_OPS = frozenset({"gt", "gteq", "lt", "lteq", "eq", "ne"})
_SAFE_LOOP = frozenset({"index", "index0", "revindex", "revindex0", "length", "first", "last"})


@dataclass(frozen=True)
class WindowSplit:
    """A template cut at its loop over the messages: `outer` (the template with the loop replaced by the variable
    strata_loop_output, its flag-guarded look-back loops stopping once their flag is cleared) and `body` (the loop's
    body, with the top-level macros it calls, as a template: the message as `target`, `loop` with first / last /
    index / index0 / previtem / nextitem, `messages` the chat). A message's output depends only on itself,
    messages[0], the messages `behind` before and `ahead` after it, whether it is the last, the render's other
    inputs, the namespaces of `threaded` (the body assigns them: their attributes as the previous message left them)
    and the values of `state` (names the outer sets before the loop) the body reads: `compared` ((name, attribute)
    of a namespace read only as an operand of a comparison: a message depends on the comparisons' outcomes) and
    `exact` (any other read: it depends on the value)."""
    outer: jinja2.Template
    body: jinja2.Template
    target: str
    behind: int
    ahead: int
    wraps: int          # the largest c of messages[loop.index0 - c]: the first c messages read from the chat's end
    state: frozenset
    compared: frozenset
    exact: frozenset
    threaded: frozenset = frozenset()


def _leftmost(test: nodes.Node) -> nodes.Node:
    while isinstance(test, nodes.And):
        test = test.left
    return test


def _safe_expr(node: nodes.Node, local: set[str]) -> bool:
    """An expression that raises either in every iteration of a loop or in none: constants, names the loop does not
    set, loop counters, |length and + - * of those."""
    if isinstance(node, nodes.Const):
        return type(node.value) in (int, str, bool)
    if isinstance(node, nodes.Name):
        return node.ctx == "load" and node.name not in local and node.name != "loop"
    if isinstance(node, nodes.Getattr):
        return isinstance(node.node, nodes.Name) and node.node.name == "loop" and node.attr in _SAFE_LOOP
    if isinstance(node, nodes.Filter):
        return (node.name in ("length", "count") and not node.args and not node.kwargs and node.dyn_args is None
                and node.dyn_kwargs is None and node.node is not None and _safe_expr(node.node, local))
    if isinstance(node, (nodes.Add, nodes.Sub, nodes.Mul)):
        return _safe_expr(node.left, local) and _safe_expr(node.right, local)
    if isinstance(node, (nodes.Neg, nodes.Pos)):
        return _safe_expr(node.node, local)
    return False


def _stop_when_cleared(loop: nodes.For) -> nodes.For | None:
    """`loop` with a break once its flag is cleared, when it is provably a look-back that does nothing after that:
    its body holds only `set name = <safe expression>` and `if` blocks (no elif / else) whose test starts with the
    same namespace flag `ns.flag and ...`. Once the flag is false no `if` runs (so nothing writes it back), the sets
    write loop-local names and raise in no later iteration, and nothing is output: the remaining iterations are no-ops.
    None when the loop is not of that shape."""
    if loop.else_ or loop.recursive or loop.test is not None:
        return None
    local = {n.name for n in loop.find_all(nodes.Name) if n.ctx in ("store", "param")}   # set anywhere in it
    flag = None
    for st in loop.body:
        if isinstance(st, nodes.Assign) and isinstance(st.target, nodes.Name):
            if not _safe_expr(st.node, local):
                return None
            continue
        if isinstance(st, nodes.If) and not st.elif_ and not st.else_:
            f = _leftmost(st.test)
            if isinstance(f, nodes.Getattr) and isinstance(f.node, nodes.Name) and f.node.name not in local:
                key = (f.node.name, f.attr)
                if flag in (None, key):
                    flag = key
                    continue
        return None
    if flag is None:
        return None
    stop = nodes.If(nodes.Not(nodes.Getattr(nodes.Name(flag[0], "load"), flag[1], "load")), [nodes.Break()], [], [])
    loop.body = list(loop.body) + [stop]
    return loop


_BODY_REFUSED = (nodes.Macro, nodes.Import, nodes.FromImport, nodes.Include, nodes.Extends, nodes.Block,
                 nodes.ExprStmt)
_NEIGHBOURS = {"previtem": -1, "nextitem": 1}


class _BodyScan:
    """What the loop's body (and the macros it calls) reads: the offsets c of messages[loop.index0 +- c] and
    loop.previtem / nextitem, the state names and their attributes, the namespaces it assigns (`threaded`: their
    values run from one message to the next), and whether it stays within what WindowSplit allows (`ok`)."""

    def __init__(self, state_names: set[str], macros: dict):
        self.state_names = state_names
        self.macros = macros                # top-level macros of the template before the loop, by name
        self.called: list[str] = []         # the macros the body calls (directly or through other macros)
        self.behind = self.ahead = self.wraps = 0
        self.loads: set[str] = set()
        self.compared: set[tuple[str, str]] = set()
        self.exact: set[tuple[str, str | None]] = set()
        self.threaded: set[str] = set()
        self.ok = True

    @staticmethod
    def _offset(arg: nodes.Node) -> int | None:
        if (isinstance(arg, (nodes.Add, nodes.Sub)) and isinstance(arg.left, nodes.Getattr)
                and isinstance(arg.left.node, nodes.Name) and arg.left.node.name == "loop"
                and arg.left.attr == "index0" and isinstance(arg.right, nodes.Const)
                and type(arg.right.value) is int and arg.right.value >= 0):
            return arg.right.value if isinstance(arg, nodes.Add) else -arg.right.value
        return None

    def _reach(self, off: int) -> None:
        if off < 0:
            self.behind = max(self.behind, -off)
        else:
            self.ahead = max(self.ahead, off)

    def visit(self, node: nodes.Node, stack: list, inner: bool) -> None:
        parent = stack[-1] if stack else None
        if isinstance(node, nodes.For) and stack:             # a nested loop: its own `loop`
            stack.append(node)
            self.visit(node.target, stack, inner)
            self.visit(node.iter, stack, inner)
            for c in ([node.test] if node.test is not None else []) + list(node.body) + list(node.else_):
                self.visit(c, stack, True)
            stack.pop()
            return
        if isinstance(node, _BODY_REFUSED) or (not inner and isinstance(node, (nodes.Break, nodes.Continue))):
            self.ok = False
            return
        if isinstance(node, nodes.NSRef):
            self.threaded.add(node.name)
            return
        if (isinstance(node, nodes.Getitem) and isinstance(node.node, nodes.Name) and node.node.name == "messages"
                and node.node.ctx == "load"):
            arg = node.arg
            self.loads.add("messages")
            if isinstance(arg, nodes.Const) and type(arg.value) is int and arg.value == 0:
                return
            off = self._offset(arg)
            if off is None or inner:                      # inside a nested loop `loop` is that loop's
                self.ok = False
                return
            self._reach(off)
            self.wraps = max(self.wraps, -off)
            return
        if isinstance(node, nodes.Name):
            if node.ctx != "load":
                return
            self.loads.add(node.name)
            if node.name == "loop" and not inner:
                if isinstance(parent, nodes.Getattr) and parent.node is node and parent.attr in _NEIGHBOURS:
                    self._reach(_NEIGHBOURS[parent.attr])
                elif not (isinstance(parent, nodes.Getattr) and parent.node is node and parent.attr in _LOOP_ATTRS):
                    self.ok = False
            elif node.name == "messages":
                self.ok = False                           # only messages[0] and messages[loop.index0 +- c]
            elif node.name in self.macros:
                if node.name not in self.called:
                    self.called.append(node.name)
                    for c in self.macros[node.name].body:    # a macro's `loop` is its own loops' (inner)
                        self.visit(c, [self.macros[node.name]], True)
                    for d in self.macros[node.name].defaults:
                        self.visit(d, [self.macros[node.name]], True)
            elif node.name in self.state_names:
                if isinstance(parent, nodes.Getattr) and parent.node is node:
                    grand = stack[-2] if len(stack) > 1 else None
                    key = (node.name, parent.attr)
                    if isinstance(grand, nodes.Compare) and grand.expr is parent and \
                            all(o.op in _COMPARE_OPS for o in grand.ops):
                        self.compared.add(key)
                    elif isinstance(grand, nodes.Operand) and grand.expr is parent and grand.op in _COMPARE_OPS and \
                            len(stack) > 2 and all(o.op in _COMPARE_OPS for o in stack[-3].ops):
                        self.compared.add(key)
                    else:
                        self.exact.add(key)
                else:
                    self.exact.add((node.name, None))
            return
        stack.append(node)
        for c in node.iter_child_nodes():
            self.visit(c, stack, inner)
        stack.pop()


def _stores(ns: list) -> set[str]:
    return {n.name for x in ns for n in x.find_all(nodes.Name) if n.ctx in ("store", "param")} | \
        {m.name for x in ns for m in x.find_all(nodes.Macro)}


def split_window(env: jinja2.Environment, source: str) -> WindowSplit | None:
    """The template cut at its loop over the messages when each message's output provably depends only on what
    WindowSplit says; None otherwise. Proven from the AST: exactly one top-level `for x in messages` (no filter,
    else or recursion) whose body (with the top-level macros it calls, which it renders with) reads `loop` only as
    loop.first / last / index / index0 / previtem / nextitem (outside its nested loops), `messages` only as
    messages[0] and messages[loop.index0 +- constant], nothing whose value changes between calls, not
    add_generation_prompt, and holds no macro, import, break / continue or `do`; a namespace it assigns is
    threaded from message to message; the rest of the template does not set `messages`, and after the loop sets no
    name the body reads, no namespace attribute, and reads no namespace the body assigns (so the state the body
    reads is the one the outer template leaves)."""
    found = _messages_loop(env, source)
    if found is None:
        return None
    tree, at, loop = found
    before, after = tree.body[:at], tree.body[at + 1:]
    pre_stores, post_stores = _stores(before), _stores(after)
    if "messages" in pre_stores | post_stores:
        return None
    if any(True for x in after for _ in x.find_all(nodes.NSRef)):
        return None
    macros = {n.name: n for n in before if isinstance(n, nodes.Macro)}
    scan = _BodyScan(pre_stores - {loop.target.name} - set(macros), macros)
    for n in loop.body:
        scan.visit(n, [loop], False)
    post_loads = {n.name for x in after for n in x.find_all(nodes.Name) if n.ctx == "load"}
    outer_loads = {n.name for x in before for n in x.find_all(nodes.Name) if n.ctx == "load"} | post_loads
    if not scan.ok or _MARK in scan.loads | outer_loads or scan.threaded & post_loads:
        return None
    if scan.loads & (post_stores | _UNSTABLE | {"add_generation_prompt"}):
        return None
    if scan.threaded - pre_stores:       # a namespace the template does not set before the loop
        return None
    tree2 = env.parse(source)
    kept = [n for n in tree2.body[:at] if isinstance(n, nodes.Macro) and n.name in scan.called]
    body_tmpl = env.from_string(nodes.Template(kept + list(tree2.body[at].body), lineno=1))
    outer_nodes = list(tree.body)
    for i, n in enumerate(outer_nodes[:at]):
        if isinstance(n, nodes.For):
            outer_nodes[i] = _stop_when_cleared(n) or n
    outer_nodes[at] = nodes.Output([nodes.Name(_MARK, "load", lineno=loop.lineno)], lineno=loop.lineno)
    outer_tmpl = env.from_string(nodes.Template(outer_nodes, lineno=1))
    threaded = frozenset(scan.threaded)
    state = frozenset((scan.loads & pre_stores) - {loop.target.name} - set(macros)) | threaded
    return WindowSplit(outer=outer_tmpl, body=body_tmpl, target=loop.target.name, behind=scan.behind,
                       ahead=scan.ahead, wraps=scan.wraps, state=state,
                       compared=frozenset(k for k in scan.compared if k not in scan.exact and k[0] not in threaded),
                       exact=frozenset(k for k in scan.exact if k[0] not in threaded), threaded=threaded)
