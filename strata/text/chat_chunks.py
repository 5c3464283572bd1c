"""MessageChunks: a chat template proven (from its jinja AST) to render each message on its own, each message's
output and its pieces kept across requests, so that a later turn renders only its new messages."""
from __future__ import annotations

import itertools
import operator
import re
import secrets
import threading
from dataclasses import dataclass

import jinja2
import jinja2.nodes as nodes

__all__ = ["LoopSplit", "MessageChunks", "Chunked", "split_template"]

#: the loop attributes a message's output may read: each depends only on its index and whether it is the last
_LOOP_ATTRS = frozenset({"first", "last", "index", "index0"})
#: globals whose value changes between calls (the time, random text, stateful helpers): a body reading one is not
#: a function of its message
_UNSTABLE = frozenset({"strftime_now", "cycler", "joiner", "lipsum", "namespace"})
_NOT_IN_BODY = (nodes.Macro, nodes.Import, nodes.FromImport, nodes.Include, nodes.Extends, nodes.Block,
                nodes.ExprStmt, nodes.NSRef)
MAX_NEW = 8192                    # more new messages in one request: the whole render answers
_MARK = "strata_loop_output"       # the outer template's stand-in for the loop's output


class _Scan:
    """What a list of template nodes reads and writes: names loaded and stored, the loop attributes read outside
    nested loops, whether `messages` is read only as messages[0] (`ok` false otherwise, or for `loop` read any
    other way than loop.<first|last|index|index0>, a break / continue of the scanned loop, or a node kind a message's
    output may not hold)."""

    def __init__(self, *, body: bool):
        self.body = body
        self.loads: set[str] = set()
        self.stores: set[str] = set()
        self.loop_attrs: set[str] = set()
        self.reads_messages = False
        self.ok = True

    def visit(self, node: nodes.Node, parent: nodes.Node | None, inner: bool) -> None:
        if isinstance(node, nodes.For) and parent is not None:          # a nested loop: its own `loop`
            self.visit(node.target, node, inner)
            self.visit(node.iter, node, inner)
            for c in ([node.test] if node.test is not None else []) + list(node.body) + list(node.else_):
                self.visit(c, node, True)
            return
        if self.body and isinstance(node, _NOT_IN_BODY):
            self.ok = False
        if self.body and not inner and isinstance(node, (nodes.Break, nodes.Continue)):
            self.ok = False
        if isinstance(node, nodes.Name):
            if node.ctx == "load":
                self.loads.add(node.name)
                if node.name == "loop" and self.body and not inner:
                    if isinstance(parent, nodes.Getattr) and parent.node is node and parent.attr in _LOOP_ATTRS:
                        self.loop_attrs.add(parent.attr)
                    else:
                        self.ok = False
                elif node.name == "messages":
                    if (isinstance(parent, nodes.Getitem) and parent.node is node
                            and isinstance(parent.arg, nodes.Const) and type(parent.arg.value) is int
                            and parent.arg.value == 0):
                        self.reads_messages = True
                    else:
                        self.ok = False
            else:
                self.stores.add(node.name)
        for c in node.iter_child_nodes():
            self.visit(c, node, inner)


@dataclass(frozen=True)
class LoopSplit:
    """A template cut in two: `outer` (the template with its loop over the messages replaced by the variable
    strata_loop_output) and `body` (the loop's body as a template of its own: the message as `target`, `loop` an
    object with first / last / index / index0). Rendering the outer with the bodies' outputs joined in place of the
    variable gives the template's output (split_template's proof)."""
    outer: jinja2.Template
    body: jinja2.Template
    target: str
    uses_loop: bool
    uses_last: bool
    reads_messages: bool        # outer or body read messages[0]
    outer_pure: bool            # the outer output is a function of its inputs (reads nothing that changes by itself)


def _messages_loop(env: jinja2.Environment, source: str):
    """(tree, index, node) of the template's one top-level `for x in messages` with no filter, else or recursion and
    a plain target other than loop / messages; None when it does not parse or has no such single loop."""
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
    return tree, at, loop


def split_template(env: jinja2.Environment, source: str) -> LoopSplit | None:
    """The template cut at its loop over the messages when each message's output provably depends only on that
    message, its index, whether it is the last, messages[0] and the render's other inputs; None otherwise. Proven
    from the AST: exactly one top-level `for x in messages` (no filter, else or recursion) whose body reads `loop`
    only as loop.first / last / index / index0 (outside its nested loops), `messages` only as messages[0], no name
    the rest of the template sets, nothing whose value changes between calls (the time, random text) and not
    add_generation_prompt (a message's cut point renders its prefix without one), and holds no namespace
    assignment, macro, import, break / continue or `do` (nothing that reaches out of one message's output); the rest
    of the template reads `messages` only as messages[0] and does not set it (so the output around the loop is the
    same for every prefix of the chat)."""
    found = _messages_loop(env, source)
    if found is None:
        return None
    tree, at, loop = found
    outer, body = _Scan(body=False), _Scan(body=True)
    for n in tree.body[:at] + tree.body[at + 1:]:
        outer.visit(n, None, True)
    for n in loop.body:
        body.visit(n, loop, False)
    if not (outer.ok and body.ok) or "messages" in outer.stores or _MARK in outer.loads | body.loads:
        return None
    if body.loads & (outer.stores | _UNSTABLE | {"add_generation_prompt"}):
        return None
    # two parses: jinja's compiler may rewrite the nodes it is given
    tree2 = env.parse(source)
    body_tmpl = env.from_string(nodes.Template(list(tree2.body[at].body), lineno=1))
    outer_nodes = list(tree.body)
    outer_nodes[at] = nodes.Output([nodes.Name(_MARK, "load", lineno=loop.lineno)], lineno=loop.lineno)
    outer_tmpl = env.from_string(nodes.Template(outer_nodes, lineno=1))
    return LoopSplit(outer=outer_tmpl, body=body_tmpl, target=loop.target.name, uses_loop=bool(body.loop_attrs),
                     uses_last="last" in body.loop_attrs, reads_messages=outer.reads_messages or body.reads_messages,
                     outer_pure=not outer.loads & _UNSTABLE)


class _Loop:
    """What a message's output reads of its loop."""
    __slots__ = ("index0", "index", "first", "last")

    def __init__(self, index0: int, last: bool):
        self.index0, self.index, self.first, self.last = index0, index0 + 1, index0 == 0, last


def _split_sentinels(stext: str, table, nonce: str) -> list[tuple[str, bool]]:
    """[(text, parse_special)] of a sentinel rendering: each sentinel of `table` (a mapping with .get) found becomes
    its client string (False), the text between them template text (True). Every sentinel is zqx{nonce}s{i}qzx or,
    tagged with the index j of its message, zqx{nonce}x{j}s{i}qzx: one small pattern whatever the number of client
    strings (the nonce is hex, so no sentinel starts inside another's text); one the table lacks (a template
    rewrote it) stays template text."""
    pieces: list[tuple[str, bool]] = []
    pat = re.compile(re.escape(f"zqx{nonce}") + r"(?:x[0-9]+)?s[0-9]+qzx")
    pos = 0
    for m in pat.finditer(stext):
        string = table.get(m.group(0))
        if string is None:
            continue
        if m.start() > pos:
            pieces.append((stext[pos:m.start()], True))
        pieces.append((string, False))
        pos = m.end()
    if pos < len(stext):
        pieces.append((stext[pos:], True))
    return pieces


def _extend(acc: list, pieces) -> None:
    """Append `pieces` ((text, is template text) pairs) to `acc`, a list of runs (fragments, is template text): a
    template text that follows a template text joins its run (as one rendering's split would give them). Only the
    last run's fragment list grows, never a string, so a long run of template texts stays linear."""
    for text, tmpl in pieces:
        if tmpl and acc and acc[-1][1]:
            acc[-1][0].append(text)
        else:
            acc.append(([text], tmpl))


def _joined(runs: list) -> list[tuple[str, bool]]:
    """The pieces of `runs` (each run's fragments joined)."""
    return [("".join(frags), tmpl) for frags, tmpl in runs]


@dataclass
class _Rec:
    """One message: its prepared copy, its output and pieces not last and (made when needed) last."""
    msg: dict
    text: str
    pieces: list
    last_text: str | None = None
    last_pieces: list | None = None
    last_error: bool = False


@dataclass
class _Chain:
    """One conversation's records under one context: the messages as the request gave them (`raws`), their key
    orders (`keys`) and whether every value was a str (`flat`; else `sigs`, see _sigs); the runs of the
    head's and the records' pieces (each not last; `acc`, see _extend), and per count j of records: how many runs
    they fill (`ends[j]`), the fragments the last of them had then (`tails[j]`: a later record's template text joins
    that run) and where their text ends after the head (`offs[j]`)."""
    ctx: str
    head: list
    recs: list[_Rec]
    raws: list
    keys: list
    flat: bool
    sigs: list | None
    acc: list
    ends: list[int]
    tails: list[int]
    offs: list[int]
    body: str             # the records' outputs (each not last) joined
    outer: dict           # add_generation_prompt -> the outer's _outer result (a pure outer, the same messages[0])


@dataclass
class Chunked:
    """A chat rendered from kept message outputs: its text, its pieces (as ChatTemplate's sentinel split gives
    them), and {message index: where its prefix rendering ends in the text} for the wanted indices that end there."""
    text: str
    pieces: list[tuple[str, bool]]
    ends: dict[int, int]
    rendered: int         # message outputs rendered for this call (the rest were kept)


def _all_str(msgs) -> bool:
    """Every value of every message is a str (type exact): equal (==) messages then render alike, given the same key
    order (1, 1.0 and True are equal but print differently). One pass in C."""
    return set(map(type, itertools.chain.from_iterable(map(dict.values, msgs)))) <= {str}


def _sigs(messages: list, k: int, chain) -> list:
    """Per message: None where every value is a str (type exact), else its repr; the first k as `chain` has them."""
    old = chain.sigs if chain is not None and k and chain.sigs is not None else None
    head = old[:k] if old is not None else [None if _all_str((m,)) else repr(m) for m in messages[:k]]
    return head + [None if _all_str((m,)) else repr(m) for m in messages[k:]]


def _strict(messages: list, keys: list, chain, k: int) -> int:
    """How many of the first k messages (equal (==) to `chain`'s) print as chain's do: those whose key orders match
    and whose values are all str where chain's were (== on str is exact), and whose repr matches where they were
    not. The reprs are taken only of messages that hold other values."""
    sigs = chain.sigs if chain.sigs is not None else [None] * len(chain.raws)     # a flat chain: every value a str
    if keys[:k] == chain.keys[:k]:
        flat = [j for j in range(k) if sigs[j] is None]
        if not flat or _all_str(operator.itemgetter(*flat)(messages) if len(flat) > 1 else (messages[flat[0]],)):
            for j in range(k):
                if sigs[j] is not None and repr(messages[j]) != sigs[j]:
                    return j
            return k
    j = 0
    while j < k and keys[j] == chain.keys[j] and (repr(messages[j]) == sigs[j] if sigs[j] is not None
                                                  else _all_str((messages[j],))):
        j += 1
    return j


def _upto(acc: list, ends: list[int], tails: list[int], j: int) -> list:
    """The runs of the head and the first j records: a new list whose last run is a copy cut to the fragments it had
    then (`tails[j]` of them), so that extending it leaves `acc` as it is."""
    out = acc[:ends[j]]
    if out:
        out[-1] = (out[-1][0][:tails[j]], out[-1][1])
    return out


class MessageChunks:
    """Renders chats through a LoopSplit, keeping each message's output and pieces (not last, and last when asked)
    for the last `keep` conversations (chains keyed by the render's other inputs); a later request reuses the
    records of the leading messages it shares exactly with a kept chain and renders the rest. `render` returns None
    where it cannot answer (a template error, a sentinel split that does not give the text back): the caller renders
    the whole chat instead, which says what is wrong. Thread-safe."""

    def __init__(self, split: LoopSplit, prepare, substitute, keep: int = 4):
        self.split = split
        self._prepare = prepare           # (message, index) -> its prepared copy (ValueError for a bad one)
        self._substitute = substitute     # (messages, nonce) -> (copies with sentinels, sentinel -> string)
        self.keep = int(keep)
        self._chains: list[_Chain] = []
        self._lock = threading.Lock()
        self._nonce = secrets.token_hex(4)
        self.stats = {"calls": 0, "fallbacks": 0, "rendered": 0, "kept": 0}

    # ---------------------------------------------------------------- one message
    def _body(self, msg, index0: int, last: bool, m0, variables) -> str:
        kw = dict(variables)
        kw[self.split.target] = msg
        kw["messages"] = [m0]
        if self.split.uses_loop:
            kw["loop"] = _Loop(index0, last)
        return self.split.body.render(**kw)

    def _pieces(self, msg, text: str, index0: int, last: bool, m0, variables):
        """The message's output split at its client strings (the sentinel method on this message and messages[0]),
        or None when the split does not give `text` back."""
        nonce = self._nonce
        while nonce in text:
            nonce = secrets.token_hex(4)
        if index0 == 0 or not self.split.reads_messages:
            (smsg,), table = self._substitute([msg], nonce)
            sm0 = smsg if index0 == 0 else m0
        else:
            (smsg, sm0), table = self._substitute([msg, m0], nonce)
        if not table:
            return [(text, True)] if text else []
        pieces = _split_sentinels(self._body(smsg, index0, last, sm0, variables), table, nonce)
        return pieces if "".join(t for t, _ in pieces) == text else None

    def _record(self, raw, index0: int, m0, variables) -> _Rec | None:
        msg = self._prepare(raw, index0) if index0 else m0
        text = self._body(msg, index0, False, m0, variables)
        pieces = self._pieces(msg, text, index0, False, m0, variables)
        return None if pieces is None else _Rec(msg=msg, text=text, pieces=pieces)

    def _last(self, rec: _Rec, index0: int, m0, variables) -> bool:
        """Fill rec's output as the last message (the same as not last when the body does not read loop.last);
        False when it cannot be rendered or split."""
        if rec.last_text is not None:
            return True
        if rec.last_error:
            return False
        if not self.split.uses_last:
            rec.last_text, rec.last_pieces = rec.text, rec.pieces
            return True
        try:
            text = self._body(rec.msg, index0, True, m0, variables)
            pieces = self._pieces(rec.msg, text, index0, True, m0, variables)
        except Exception:
            pieces = None
        if pieces is None:
            rec.last_error = True
            return False
        rec.last_text, rec.last_pieces = text, pieces
        return True

    def _outer(self, m0, agp: bool, variables):
        """(head, tail, head pieces, tail pieces): the outer template's output before and after the loop's, split
        at the client strings of messages[0] when it reads them; None when that split fails."""
        mark = f"\x00{self._nonce}\x00"
        kw = dict(variables, messages=[m0], add_generation_prompt=agp)
        kw[_MARK] = mark
        out = self.split.outer.render(**kw).split(mark)
        if len(out) != 2:
            return None
        head, tail = out
        if not self.split.reads_messages:
            return head, tail, [(head, True)] if head else [], [(tail, True)] if tail else []
        nonce = self._nonce
        while nonce in head or nonce in tail:
            nonce = secrets.token_hex(4)
        (sm0,), table = self._substitute([m0], nonce)
        if not table:
            return head, tail, [(head, True)] if head else [], [(tail, True)] if tail else []
        kw["messages"] = [sm0]
        sout = self.split.outer.render(**kw).split(mark)
        if len(sout) != 2:
            return None
        hp, tp = _split_sentinels(sout[0], table, nonce), _split_sentinels(sout[1], table, nonce)
        if "".join(t for t, _ in hp) != head or "".join(t for t, _ in tp) != tail:
            return None
        return head, tail, hp, tp

    # ---------------------------------------------------------------- a chat
    def render(self, messages: list, agp: bool, variables: dict, ctx: str, wanted) -> Chunked | None:
        """The chat `messages` (as the request gave them) rendered with add_generation_prompt `agp` and `variables`
        (tools, documents, bos_token, ...; `ctx` an exact text of every input but the messages and agp), and the
        prefix ends of the `wanted` message indices (render(messages[:i+1], add_generation_prompt=False), where it
        is a prefix of the text); None where it cannot answer (see the class)."""
        n = len(messages)
        if n == 0 or set(map(type, messages)) != {dict}:
            return None
        keys = list(map(tuple, messages))
        chain, k = self._find(ctx, messages, keys)
        if n - k > MAX_NEW:       # a message's own render costs ~50x its share of the whole one
            return None
        recs: list[_Rec] = chain.recs[:k] if chain is not None else []
        outer = dict(chain.outer) if chain is not None and k and self.split.outer_pure else {}
        try:
            m0 = recs[0].msg if recs else self._prepare(messages[0], 0)
            for a in {agp, False}:
                if a not in outer:
                    outer[a] = self._outer(m0, a, variables)
            full, bare = outer[agp], outer[False]
            if full is None or bare is None:
                return self._fallback()
            head, tail, head_p, tail_p = full
            for i in range(k, n):
                rec = self._record(messages[i], i, m0, variables)
                if rec is None:
                    return self._fallback()
                recs.append(rec)
            last = recs[-1]
            if not self._last(last, n - 1, m0, variables):
                return self._fallback()
        except Exception:        # the whole render says what is wrong (or renders where a lone message does not)
            return self._fallback()
        # the merged pieces: the kept chain's up to the shared records (when its head is this one's), then the rest
        if chain is not None and k > 0 and chain.head == head_p:
            acc = _upto(chain.acc, chain.ends, chain.tails, k)
            ends, tails, offs = chain.ends[:k + 1], chain.tails[:k + 1], chain.offs[:k + 1]
            body = chain.body[:offs[-1]]
            start = k
        else:
            acc = []
            _extend(acc, head_p)
            ends, tails, offs = [len(acc)], [len(acc[-1][0]) if acc else 0], [0]
            body = ""
            start = 0
        for i in range(start, n):
            _extend(acc, recs[i].pieces)
            ends.append(len(acc))
            tails.append(len(acc[-1][0]) if acc else 0)
            offs.append(offs[-1] + len(recs[i].text))
        pieces = _upto(acc, ends, tails, n - 1)
        _extend(pieces, last.last_pieces)
        _extend(pieces, tail_p)
        pieces = _joined(pieces)
        body += "".join([r.text for r in recs[start:]])
        text = head + body[:offs[n - 1]] + last.last_text + tail
        # render(messages[:i+1], add_generation_prompt=False) is bare's head, the outputs before i, i's output as
        # the last, bare's tail: an end where that is a prefix of the text
        ends_out: dict[int, int] = {}
        bhead, btail = bare[0], bare[1]
        if bhead == head:
            for i in wanted:
                if not 0 <= i < n:
                    continue
                rec = recs[i]
                try:
                    if not self._last(rec, i, m0, variables):
                        continue
                except Exception:
                    continue
                pos = len(head) + offs[i]
                if text.startswith(rec.last_text, pos) and text.startswith(btail, pos + len(rec.last_text)):
                    ends_out[i] = pos + len(rec.last_text) + len(btail)
        flat = (chain.flat if chain is not None and k else True) and _all_str(messages[k:])
        sigs = None if flat else _sigs(messages, k, chain)
        self._keep(_Chain(ctx=ctx, head=head_p, recs=recs, raws=list(messages), keys=keys, flat=flat, sigs=sigs,
                          acc=acc, ends=ends, tails=tails, offs=offs, body=body, outer=outer),
                   chain if chain is not None and k == len(chain.raws) else None)
        with self._lock:
            self.stats["calls"] += 1
            self.stats["rendered"] += n - k
            self.stats["kept"] += k
        return Chunked(text=text, pieces=pieces, ends=ends_out, rendered=n - k)

    def quick(self, messages: list, max_new: int = 8, max_chars: int = 16384) -> bool:
        """Whether a render of `messages` will likely reuse a kept conversation with at most `max_new` new messages of
        at most `max_chars` characters of content in all (so it costs about a millisecond and may run where a wait
        would cost more); a guess in O(new messages), never a promise: render decides."""
        n = len(messages)
        with self._lock:
            chains = list(self._chains)
        for c in chains:
            k = len(c.raws)
            if not k <= n <= k + max_new or type(messages[0]) is not dict or type(messages[k - 1]) is not dict:
                continue
            if messages[k - 1] != c.raws[-1] or messages[0] != c.raws[0]:
                continue
            new = 0
            for m in messages[k:]:
                content = m.get("content") if type(m) is dict else None
                new += len(content) if isinstance(content, str) else max_chars + 1
            if new <= max_chars:
                return True
        return False

    def _fallback(self):
        with self._lock:
            self.stats["fallbacks"] += 1
        return None

    def _find(self, ctx: str, messages: list, keys: list) -> tuple[_Chain | None, int]:
        """The kept chain of context `ctx` sharing the most leading messages exactly, and how many."""
        with self._lock:
            chains = list(self._chains)
        best, best_k = None, 0
        for c in chains:
            if c.ctx != ctx:
                continue
            raws = c.raws
            m = min(len(raws), len(messages))
            if messages[:m] == raws[:m]:      # the comparing runs in C
                k = m
            else:
                lo, hi = 0, m
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if messages[:mid] == raws[:mid]:
                        lo = mid
                    else:
                        hi = mid - 1
                k = lo
            if k <= best_k:
                continue
            # equal (==) is not enough: 1, 1.0 and True are equal and print differently, key orders may differ
            if not (c.flat and keys[:k] == c.keys[:k] and _all_str(messages[:k])):
                k = _strict(messages, keys, c, k)
            if k > best_k:
                best, best_k = c, k
        return best, best_k

    def _keep(self, chain: _Chain, extended: _Chain | None) -> None:
        """Keep `chain` first, dropping `extended` (the kept chain it continues) and the least recently kept past
        `keep`."""
        if self.keep <= 0:
            return
        with self._lock:
            self._chains = [c for c in self._chains if c is not extended][: self.keep - 1]
            self._chains.insert(0, chain)
