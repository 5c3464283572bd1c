"""WindowChunks: message outputs kept across requests for chat templates a WindowSplit proves windowed; a later turn
re-renders only the messages whose output can have changed (their neighbours or the pre-loop state they read)."""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field

import jinja2.utils

from strata.text.chat_chunks import (_MARK, MAX_NEW, Chunked, MessageChunks, _all_str, _extend, _joined, _sigs,
                                     _split_sentinels, _upto)
from strata.text.window_proof import WindowSplit

__all__ = ["WindowChunks"]

_PY_OPS = {"gt": operator.gt, "ge": operator.ge, "lt": operator.lt, "le": operator.le, "eq": operator.eq,
           "ne": operator.ne}
_SCALARS = (str, int, float, bool, type(None))


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
