"""WindowChunks: message outputs kept across requests for chat templates whose messages see their neighbours and the
state computed before the loop (Qwen's look-back for the last user query, tool results grouped with their
neighbours), proven from the jinja AST; a later turn re-renders only the messages whose output can have changed."""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field

import jinja2
import jinja2.nodes as nodes
import jinja2.utils

from strata.text.chat_chunks import (_LOOP_ATTRS, _MARK, _UNSTABLE, MAX_NEW, Chunked, MessageChunks, _all_str,
                                     _extend, _joined, _sigs, _split_sentinels, _upto)

__all__ = ["WindowSplit", "WindowChunks", "split_window"]

_COMPARE_OPS = frozenset({"gt", "gteq", "lt", "lteq", "eq", "ne"})
_PY_OPS = {"gt": operator.gt, "ge": operator.ge, "lt": operator.lt, "le": operator.le, "eq": operator.eq,
           "ne": operator.ne}
_SAFE_LOOP = frozenset({"index", "index0", "revindex", "revindex0", "length", "first", "last"})
_SCALARS = (str, int, float, bool, type(None))


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
    try:
        tree = env.parse(source)
    except jinja2.TemplateError:
        return None
    loops = [i for i, n in enumerate(tree.body) if isinstance(n, nodes.For)
             and isinstance(n.iter, nodes.Name) and n.iter.name == "messages"]
    if len(loops) != 1:
        return None
    at = loops[0]
    loop = tree.body[at]
    if (loop.test is not None or loop.else_ or loop.recursive or not isinstance(loop.target, nodes.Name)
            or loop.target.name in ("loop", "messages")):
        return None
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


class _Traced(int):
    """An int state attribute read only as an operand of comparisons: each comparison is recorded (the outcome is
    what the message's output depends on)."""

    def __new__(cls, value: int, key, sink: list):
        self = super().__new__(cls, value)
        self._key, self._sink = key, sink
        return self

    def _cmp(self, other, op: str):
        result = _PY_OPS[op](int(self), other)
        if type(other) in (int, float, bool) and type(result) is bool:
            self._sink.append((self._key, op, other, result))
        else:
            self._sink.append((self._key, "exact", int(self), None))
        return result

    def __lt__(self, o):
        return self._cmp(o, "lt")

    def __le__(self, o):
        return self._cmp(o, "le")

    def __gt__(self, o):
        return self._cmp(o, "gt")

    def __ge__(self, o):
        return self._cmp(o, "ge")

    def __eq__(self, o):
        return self._cmp(o, "eq")

    def __ne__(self, o):
        return self._cmp(o, "ne")

    __hash__ = int.__hash__


def _ns_attrs(v) -> dict | None:
    if isinstance(v, jinja2.utils.Namespace):
        return object.__getattribute__(v, "_Namespace__attrs")
    return None


@dataclass
class _State:
    """The outer template's result for one chat: head and tail (its output before and after the loop's), the
    values the body reads (`values`: name -> value, a namespace's attributes as a dict), and `key`: the exact
    dependencies' values."""
    head: str
    tail: str
    values: dict
    key: tuple
    types: dict = field(default_factory=dict)     # name -> the namespace class of a namespace value


# ------------------------------------------------------------------------------------------------ guard boxes
# A box: {(name, attribute): (lower, upper)} of the traced values under which a record's comparisons all come out
# as they did. lower (v, open): value > v (open) or >= v; upper (v, open): value < v (open) or <= v.
_NO_LOWER = (float("-inf"), False)
_NO_UPPER = (float("inf"), False)


def _bounds(op: str, other, result: bool, value) -> tuple[tuple, tuple]:
    """The (lower, upper) of the values v for which `v op other` is `result` (v was `value` when it was recorded)."""
    if op == "exact":
        return (value, False), (value, False)
    if op == "eq" and result or op == "ne" and not result:
        return (other, False), (other, False)
    if op in ("eq", "ne"):                     # v != other: the side of it that `value` is on
        return ((other, True), _NO_UPPER) if value > other else (_NO_LOWER, (other, True))
    below = {"lt": result, "le": result, "gt": not result, "ge": not result}[op]
    strict = {"lt": result, "le": not result, "gt": result, "ge": not result}[op]
    return (_NO_LOWER, (other, strict)) if below else ((other, strict), _NO_UPPER)


def _tighter(a: tuple, b: tuple, lower: bool) -> tuple:
    if lower:
        return a if (a[0], a[1]) >= (b[0], b[1]) else b
    return a if (a[0], not a[1]) <= (b[0], not b[1]) else b


def _box(guards: list, values: dict) -> dict:
    box: dict = {}
    for key, op, other, result in guards:
        v = values.get(key[0])
        lo, hi = _bounds(op, other, result, v.get(key[1]) if isinstance(v, dict) else None)
        if key in box:
            lo, hi = _tighter(box[key][0], lo, True), _tighter(box[key][1], hi, False)
        box[key] = (lo, hi)
    return box


def _meet(a: dict, b: dict) -> dict:
    if not b:
        return a
    if not a:
        return b
    out = dict(a)
    for key, (lo, hi) in b.items():
        if key in out:
            lo, hi = _tighter(out[key][0], lo, True), _tighter(out[key][1], hi, False)
        out[key] = (lo, hi)
    return out


def _inside(box: dict, values: dict) -> bool:
    for (name, attr), ((lo, lo_open), (hi, hi_open)) in box.items():
        v = values.get(name)
        v = v.get(attr) if isinstance(v, dict) else None
        if type(v) is not int:
            return False
        if (v <= lo if lo_open else v < lo) or (v >= hi if hi_open else v > hi):
            return False
    return True


@dataclass
class _Rec:
    """One message's output as not the last (`text`, `pieces`), rendered under a state: the box of traced values
    under which its comparisons come out the same (`box`, `sbox` for its sentinel rendering) and the threaded
    namespaces' attributes it found and left (`tin`, `tout`; `stin`, `stout` for its sentinel rendering)."""
    text: str
    pieces: list
    box: dict
    sbox: dict
    tin: dict
    tout: dict
    stin: dict
    stout: dict


class _WLoop:
    """What a message's output reads of its loop (jinja's loop.previtem / nextitem are undefined at the ends)."""
    __slots__ = ("index0", "index", "first", "last", "_msgs", "_undefined")

    def __init__(self, index0: int, last: bool, msgs: list, undefined):
        self.index0, self.index, self.first, self.last = index0, index0 + 1, index0 == 0, last
        self._msgs, self._undefined = msgs, undefined

    @property
    def previtem(self):
        return self._undefined("there is no previous item") if self.first else self._msgs[self.index0 - 1]

    @property
    def nextitem(self):
        return self._undefined("there is no next item") if self.last else self._msgs[self.index0 + 1]


@dataclass
class _WChain:
    """One conversation: the messages as given (raws, keys, flat, sigs as MessageChunks' chains), their prepared and
    sentinel copies and sentinel tables, the records (not last) of all but the last message with `cum[j]` the meet
    of the boxes of records [wraps, j) (real, sentinel), the exact dependencies' keys the records hold under
    (`key`, `skey`), the texts as they stand in the chat's text, its head and head pieces, the runs of the head's
    and the records' pieces (`acc`, `ends`, `tails` as MessageChunks' chains), and its prefix ends (i -> ("end",
    position), ("miss", first differing position) or ("error", 0))."""
    ctx: str
    raws: list
    keys: list
    flat: bool
    sigs: list | None
    msgs: list
    smsgs: list
    tables: list
    recs: list
    cum: list
    key: tuple
    skey: tuple
    texts: list
    head: str
    head_p: list
    acc: list
    ends: list
    tails: list
    jruns: list
    pends: dict = field(default_factory=dict)


class _Tables:
    """The sentinel tables of a chat's messages as one mapping: a tagged sentinel names its message."""
    __slots__ = ("tables", "nonce")

    def __init__(self, tables: list, nonce: str):
        self.tables, self.nonce = tables, nonce

    def get(self, key: str):
        at = 3 + len(self.nonce)
        if key[at:at + 1] != "x":
            return None
        try:
            return self.tables[int(key[at + 1:key.index("s", at)])].get(key)
        except (ValueError, IndexError):
            return None


def _common(a: str, pos: int, b: str) -> int:
    """The length of the common prefix of a[pos:] and b."""
    lo, hi = 0, min(len(b), len(a) - pos)
    if a.startswith(b[:hi], pos):
        return hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a.startswith(b[:mid], pos):
            lo = mid
        else:
            hi = mid - 1
    return lo


class WindowChunks(MessageChunks):
    """Renders chats through a WindowSplit, keeping each message's output across requests (the last `keep`
    conversations); a later request reuses the output of a leading message it shares exactly with a kept chain
    when the messages it reads are shared too, the threaded namespaces reach it alike and the state's comparisons
    it made come out the same, and renders the rest. The same contract as MessageChunks.render (None where it cannot
    answer). Thread-safe."""

    def __init__(self, split: WindowSplit, prepare, substitute, keep: int = 4):
        super().__init__(split, prepare, substitute, keep)
        self.stats["prefix_renders"] = 0

    # ---------------------------------------------------------------- the outer template
    def _outer(self, msgs: list, agp: bool, variables) -> _State | None:
        sp = self.split
        mark = f"\x00{self._nonce}\x00"
        kw = dict(variables, messages=msgs, add_generation_prompt=agp)
        kw[_MARK] = mark
        ctx = sp.outer.new_context(kw)
        out = sp.outer.environment.concat(sp.outer.root_render_func(ctx)).split(mark)
        if len(out) != 2:
            return None
        values, key, types = {}, [], {}
        for name in sp.state:
            if name not in ctx.vars:
                continue
            v = ctx.vars[name]
            attrs = _ns_attrs(v)
            values[name] = dict(attrs) if attrs is not None else v
            if attrs is not None:
                types[name] = type(v)
        # a value read other than as a namespace attribute compared: the output depends on it (on the whole value
        # where it is not a namespace)
        deps = set(sp.exact) | {(name, None) for name, _ in sp.compared if not isinstance(values.get(name), dict)} \
            | {(name, a) for name, a in sp.compared if isinstance(values.get(name), dict)
               and type(values[name].get(a)) is not int}          # only an int's comparisons are traced
        for name, attr in sorted(deps, key=str):
            if name not in values:
                continue
            v = values[name]
            if isinstance(v, dict):
                v = v.get(attr) if attr is not None else tuple(sorted(v.items(), key=str))
            else:
                attr = None
            if not (type(v) in _SCALARS or (type(v) is tuple and all(type(x) in _SCALARS for _, x in v))):
                return None
            key.append((name, attr, type(v), v))
        return _State(out[0], out[1], values, tuple(key), types)

    def _threads(self, st: _State) -> dict | None:
        """The threaded namespaces' attributes as the outer template leaves them (None when one is not a
        namespace)."""
        out = {}
        for name in self.split.threaded:
            v = st.values.get(name)
            if not isinstance(v, dict):
                return None
            out[name] = v
        return out

    # ---------------------------------------------------------------- one message
    def _body(self, msgs: list, i: int, last: bool, state: _State, variables, tin: dict):
        """(output, the comparisons it made, the threaded namespaces' attributes it left) of message i."""
        sink: list = []
        kw = dict(variables)
        for name, v in state.values.items():
            if name in tin:
                kw[name] = state.types[name](dict(tin[name]))
            elif isinstance(v, dict):
                attrs = dict(v)
                for (n, a) in self.split.compared:
                    if n == name and a in attrs and type(attrs[a]) is int:
                        attrs[a] = _Traced(attrs[a], (n, a), sink)
                kw[name] = state.types[name](attrs)
            else:
                kw[name] = v
        kw[self.split.target] = msgs[i]
        kw["messages"] = msgs
        body = self.split.body
        kw["loop"] = _WLoop(i, last, msgs, body.environment.undefined)
        text = body.render(**kw)
        return text, sink, {name: dict(_ns_attrs(kw[name])) for name in tin}

    def _one(self, msgs, smsgs, tables, i: int, last: bool, st: _State, sst: _State, variables, tin, stin):
        """The _Rec of message i, or None when its sentinel split does not give the text."""
        text, guards, tout = self._body(msgs, i, last, st, variables, tin)
        stext, sguards, stout = self._body(smsgs, i, last, sst, variables, stin)
        pieces = _split_sentinels(stext, _Tables(tables, self._nonce), self._nonce)
        if "".join(t for t, _ in pieces) != text:
            return None
        return _Rec(text, pieces, _box(guards, st.values), _box(sguards, sst.values), tin, tout, stin, stout)

    # ---------------------------------------------------------------- a chat
    def render(self, messages: list, agp: bool, variables: dict, ctx: str, wanted) -> Chunked | None:
        n = len(messages)
        if n == 0 or set(map(type, messages)) != {dict}:
            return None
        keys = list(map(tuple, messages))
        chain, k = self._find(ctx, messages, keys)
        if n - k > MAX_NEW:
            return None
        sp, nonce = self.split, self._nonce
        lead = sp.wraps           # records [0, lead) read the chat's last messages: rendered every time
        if f"zqx{nonce}" in ctx:
            return self._fallback()
        if chain is None or not k:
            chain, k = None, 0
        try:
            if chain is not None:
                msgs, smsgs, tables = chain.msgs[:k], chain.smsgs[:k], chain.tables[:k]
            else:
                msgs, smsgs, tables = [], [], []
            for j in range(k, n):
                m = self._prepare(messages[j], j)
                if f"zqx{nonce}" in repr(m):
                    return self._fallback()
                (sm,), table = self._substitute([m], f"{nonce}x{j}")
                msgs.append(m)
                smsgs.append(sm)
                tables.append(table)
            st, sst = self._outer(msgs, agp, variables), self._outer(smsgs, agp, variables)
            if st is None or sst is None:
                return self._fallback()
            tabs = _Tables(tables, nonce)
            head_p = _split_sentinels(sst.head, tabs, nonce)
            tail_p = _split_sentinels(sst.tail, tabs, nonce)
            if "".join(t for t, _ in head_p) != st.head or "".join(t for t, _ in tail_p) != st.tail:
                return self._fallback()
            tin, stin = self._threads(st), self._threads(sst)
            if tin is None or stin is None:
                return self._fallback()
            recs: list[_Rec] = []
            rendered = 0
            old = chain.recs if chain is not None else []
            same_key = chain is not None and chain.key == st.key and chain.skey == sst.key
            reuse_below = min(k - sp.ahead, len(old))
            bulk = 0          # records [lead, bulk) taken from the chain at once
            j = 0
            while j < n - 1:
                if j == lead and same_key and reuse_below > lead and old[j].tin == tin and \
                        old[j].stin == stin and _inside(chain.cum[reuse_below][0], st.values) and \
                        _inside(chain.cum[reuse_below][1], sst.values):
                    bulk = reuse_below
                    recs += old[lead:bulk]
                    tin, stin = old[bulk - 1].tout, old[bulk - 1].stout
                    j = bulk
                    continue
                if lead <= j < reuse_below and same_key and old[j].tin == tin and old[j].stin == stin and \
                        _inside(old[j].box, st.values) and _inside(old[j].sbox, sst.values):
                    r = old[j]
                else:
                    r = self._one(msgs, smsgs, tables, j, False, st, sst, variables, tin, stin)
                    if r is None:
                        return self._fallback()
                    rendered += 1
                recs.append(r)
                tin, stin = r.tout, r.stout
                j += 1
            last = self._one(msgs, smsgs, tables, n - 1, True, st, sst, variables, tin, stin)
            if last is None:
                return self._fallback()
            rendered += 1
        except Exception:        # the whole render says what is wrong (or renders where a piece does not)
            return self._fallback()
        # the boxes' meets and the pieces' runs: the chain's up to the records it shares (when those before `lead`
        # and the head came out the same), then the rest
        same = 0
        if chain is not None and chain.head_p == head_p:
            lim = min(len(recs), len(old))
            while same < min(lead, lim) and recs[same].pieces == old[same].pieces:
                same += 1
            if same == lead:
                same = max(same, min(bulk, lim))
                while same < lim and recs[same] is old[same]:
                    same += 1
        if same:
            acc = _upto(chain.acc, chain.ends, chain.tails, same)
            ends, tails = chain.ends[:same + 1], chain.tails[:same + 1]
            jruns = chain.jruns[:max(0, ends[-1] - 1)]      # the runs no later record can join, joined
        else:
            acc = []
            _extend(acc, head_p)
            ends, tails = [len(acc)], [len(acc[-1][0]) if acc else 0]
            jruns = []
        for r in recs[same:]:
            _extend(acc, r.pieces)
            ends.append(len(acc))
            tails.append(len(acc[-1][0]) if acc else 0)
        jruns += _joined(acc[len(jruns):])
        cum = chain.cum[:max(same, lead) + 1] if same > lead else [None] * lead + [({}, {})]
        for j in range(len(cum) - 1, len(recs)):
            cum.append((_meet(cum[j][0], recs[j].box), _meet(cum[j][1], recs[j].sbox)))
        end = _upto(acc, ends, tails, len(recs))[-1:]       # the last run, which the last message may join
        _extend(end, last.pieces)
        _extend(end, tail_p)
        pieces = jruns[:-1] + _joined(end) if end and acc else jruns + _joined(end)
        texts = [r.text for r in recs] + [last.text]
        text = st.head + "".join(texts) + st.tail
        offs = list(itertools.accumulate(map(len, texts), initial=len(st.head)))
        # where this text starts to differ from the kept chat's (its prefix ends before that still hold): the
        # records it shares are the same text
        stable = 0
        if chain is not None and chain.head == st.head:
            j = same
            while j < min(len(chain.texts), n) and texts[j] == chain.texts[j]:
                j += 1
            stable = offs[j]
        ends_out: dict[int, int] = {}
        pends: dict = {}
        for i in sorted(wanted):
            if not 0 <= i < n or (i == n - 1 and not agp):
                continue
            kept = chain.pends.get(i) if chain is not None and i < k else None
            if kept is not None and ((kept[0] == "end" and kept[1] <= stable) or (kept[0] == "miss" and
                                                                                  kept[1] < stable)
                                     or kept[0] == "error"):
                got = kept
            else:
                try:
                    got = self._prefix_end(i, msgs, recs, cum, texts, offs, text, st, variables)
                except Exception:        # the prefix does not render: no end (a function of the prefix)
                    got = ("error", 0)
            if got is None:
                continue
            pends[i] = got
            if got[0] == "end":
                ends_out[i] = got[1]
        flat = (chain.flat if chain is not None else True) and _all_str(messages[k:])
        sigs = None if flat else _sigs(messages, k, chain)
        self._keep(_WChain(ctx=ctx, raws=list(messages), keys=keys, flat=flat, sigs=sigs, msgs=msgs, smsgs=smsgs,
                           tables=tables, recs=recs, cum=cum, key=st.key, skey=sst.key, texts=texts, head=st.head,
                           head_p=head_p, acc=acc, ends=ends, tails=tails, jruns=jruns, pends=pends),
                   chain if chain is not None and k == len(chain.raws) else None)
        with self._lock:
            self.stats["calls"] += 1
            self.stats["rendered"] += rendered
            self.stats["kept"] += n - rendered
        return Chunked(text=text, pieces=pieces, ends=ends_out, rendered=rendered)

    def _prefix_end(self, i: int, msgs, recs, cum, texts, offs, text: str, st: _State, variables):
        """("end", len(render(messages[:i+1], add_generation_prompt=False))) when that is a prefix of `text`, else
        ("miss", the first position where they differ): the prefix's outer template run, the outputs of the
        messages before i that read only messages within the prefix, find the threaded namespaces alike and make the
        same comparisons under its state taken from this chat, the rest rendered."""
        sp = self.split
        with self._lock:
            self.stats["prefix_renders"] += 1
        pm = msgs[:i + 1]
        pst = self._outer(pm, False, variables)
        if pst is None:
            return None
        if not text.startswith(pst.head):
            return "miss", _common(text, 0, pst.head)
        tin = self._threads(pst)
        if tin is None:
            return None
        upto = i - sp.ahead + 1          # records [wraps, upto) read only messages of the prefix
        pos = len(pst.head)
        j = 0
        while j < i:
            r = recs[j]
            if j == sp.wraps < upto and pst.key == st.key and r.tin == tin and pos == offs[j] and \
                    _inside(cum[upto][0], pst.values):
                pos, tin, j = offs[upto], recs[upto - 1].tout, upto     # all of them as in this chat
                continue
            if sp.wraps <= j < upto and pst.key == st.key and r.tin == tin and _inside(r.box, pst.values):
                t, tin = r.text, r.tout     # this output under the prefix's state and messages
            else:
                t, _, tin = self._body(pm, j, False, pst, variables, tin)
            if pos != offs[j] or t != texts[j]:
                if not text.startswith(t, pos):
                    return "miss", pos + _common(text, pos, t)
            pos += len(t)
            j += 1
        t, _, _ = self._body(pm, i, True, pst, variables, tin)
        t += pst.tail
        if not text.startswith(t, pos):
            return "miss", pos + _common(text, pos, t)
        return "end", pos + len(t)
