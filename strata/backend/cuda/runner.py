"""The graph runner every family's CUDA plan shares: DecodePlan (buffers at fixed addresses, one CUDA graph captured
per context-size class and replayed per token, the decode entry points, the launch blocks both families' layers are
built of, and the prefill's start and end) and PlanModel (what the engine runs: the model, with one-token and
long forwards routed to the plan of the sequence's page pool)."""
from __future__ import annotations

import time
from typing import Any, ClassVar

import numpy as np

from strata.backend.cuda import settings
from strata.backend.cuda.gemm import PrefillScratch
from strata.backend.cuda.library import addr, check, ffi, fptr, lib, ptr, stream_ptr
from strata.backend.cuda.pages import CudaPagePool, check_sequence
from strata.backend.cuda.settings import MV_BLOCK_ROWS, glu_pairs_per_warp, rows_per_warp


def carve_bounds(lo: int, hi: int | None, n_layer: int) -> tuple[int, int]:
    """(lo, hi) of a plan's carve, the layers [lo, hi) of a model of n_layer blocks (hi None: all of them);
    ValueError unless 0 <= lo < hi <= n_layer."""
    lo, hi = int(lo), n_layer if hi is None else int(hi)
    if not 0 <= lo < hi <= n_layer:
        raise ValueError(f"carve [{lo}, {hi}) is not a non-empty range of the model's {n_layer} blocks")
    return lo, hi


def hidden_input(x_in, n: int, n_embd: int, first: bool, device_id: int):
    """A stage's input x_in checked and viewed as (n, n_embd), or None for the first stage (whose input is the
    embedding rows). ValueError / TypeError (one line) unless a later stage gets a CuPy float32 array of n * n_embd
    elements on device device_id, and the first stage none."""
    if first:
        if x_in is not None:
            raise ValueError("x_in is the input of a stage after the first (the first embeds its tokens)")
        return None
    import cupy
    if not isinstance(x_in, cupy.ndarray):
        raise TypeError(f"a stage after the first needs x_in, a CuPy float32 ({n}, {n_embd}) array "
                        f"(got {type(x_in).__name__})")
    if x_in.dtype != np.float32 or x_in.size != n * n_embd or x_in.device.id != device_id:
        raise ValueError(f"x_in is {x_in.dtype} {tuple(x_in.shape)} on device {x_in.device.id}; the stage needs "
                         f"float32 ({n}, {n_embd}) on device {device_id}")
    return x_in.reshape(n, n_embd)


def prefill_logits(model, x, all_logits: bool, eps: float, hidden: bool = False):
    """A prefill plan's last step: the final RMSNorm (model.out_norm) of the last row of x, or of every row with
    all_logits, and the output projection (model.output, through the backend's matmul) -> host f32 (n_vocab,) or
    (n, n_vocab); with hidden, (those logits, the final-normed rows of every row, CuPy f32 (n, n_embd)). x: CuPy
    f32 (n, n_embd), the residual stream after the last layer."""
    import cupy as cp
    rows = x if all_logits or hidden else x[x.shape[0] - 1:]
    hn = cp.empty(rows.shape, cp.float32)
    NULL = ffi().NULL
    check(lib().strata_rms_norm_ex(stream_ptr(), ptr(rows), NULL, ptr(model.out_norm), ptr(hn), NULL, NULL, NULL,
                                   rows.shape[0], rows.shape[1], float(eps)), "rms_norm")
    out = cp.asnumpy(model.backend.matmul(hn if all_logits else hn[hn.shape[0] - 1:], model.output))
    out = out if all_logits else out[0]
    return (out, hn) if hidden else out


def token_id(t, n_vocab: int) -> int:
    """t as a Python int; ValueError (the model's message) when it is not an integer id in [0, n_vocab)."""
    v = int(t)
    if v != t or not 0 <= v < n_vocab:
        raise ValueError(f"token id out of range [0, {n_vocab})")
    return v


def q8_buffer(cp, n: int):
    """A q8_1 activation buffer for n values: int8 values, then float2 (d, d * sum) per 32."""
    return cp.zeros(n + n // 4, cp.uint8)


class DecodePlan:
    """A family's layers executed on one GPU: subclasses (strata/backend/cuda/llama.py, qwen35.py) enqueue their fused
    kernels (``_enqueue_step``, ``_step_args``, ``prefill``) and say which carves they run (``unsupported``); this
    class owns everything around them.

    * Buffers at fixed addresses in ``self.d`` (graph capture): ``inp`` = [token, pos, len] (int32, read by the
      kernels, so one captured graph serves every token of its class), the residual stream ``x``, the normed row
      ``hn`` and its q8_1 blocks ``hq``, the layer output ``o``, the FFN's ``gu`` / ``act`` / ``fq``, ``logits``;
      with attention layers also ``qkv``, ``att`` / ``aq``, ``partial`` and ``counters`` of the split-K kernels.
    * The decode step: ``decode_device`` / ``decode`` / ``decode_greedy`` check the sequence (changing nothing on
      error), reserve its pages, write ``inp`` and replay the graph of the step's context-size class
      (settings.size_class; captured on first use, ``use_graphs`` False: the kernels launched eagerly).
    * The carve [lo, hi): the first stage embeds its token, a later one starts from ``x_in`` (the previous stage's
      residual stream, copied into ``d['x']`` outside the graph); the last ends with the final norm, the output
      matvec and the device argmax into ``inp[0]``, an earlier one returns its residual stream.
    """

    label: ClassVar[str] = "CUDA decode plan"     # how errors name the plan
    mv_block_from = 0            # long-row matvecs run a block per row from this many sub-blocks per row (0: never)

    def __init__(self, model, pool, use_graphs: bool | None = None, lo: int = 0, hi: int | None = None):
        why = self.unsupported(model, lo, hi)
        if why:
            raise ValueError(f"the {self.label} cannot run this model: {why}")
        lo, hi = carve_bounds(lo, hi, model.n_blocks)
        if not isinstance(pool, CudaPagePool):
            raise TypeError(f"{type(self).__name__} needs the CudaPagePool made by CudaBackend.new_page_pool")
        cp = self.cp = __import__("cupy")
        lib()
        self.model, self.pool = model, pool
        c = model.config
        self.n_embd, self.n_head, self.n_kv, self.hd = c.n_embd, c.n_head, c.n_head_kv, c.head_dim
        self.n_ff, self.n_vocab = c.n_ff, c.n_vocab
        self.n_rot, self.theta, self.eps = int(model.n_rot), float(c.rope_theta), float(model.eps)
        self.scale = float(model.scale)
        self.lo, self.hi = lo, hi                                   # the carve: layers [lo, hi)
        self.first, self.last = lo == 0, model.ends_with_head(hi)   # the embeddings / the final norm and head
        self.use_graphs = settings.graphs_enabled() if use_graphs is None else bool(use_graphs)
        self.dp4a = settings.DP4A
        self.n_sm = int(model.backend.n_sm)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.graphs: dict[Any, Any] = {}
        E, F = self.n_embd, self.n_ff
        self.d = {"inp": cp.zeros(3, cp.int32), "x": cp.zeros((1, E), cp.float32), "hn": cp.zeros((1, E), cp.float32),
                  "hq": q8_buffer(cp, E), "o": cp.zeros((1, E), cp.float32), "gu": cp.zeros((1, 2 * F), cp.float32),
                  "act": cp.zeros((1, F), cp.float32), "fq": q8_buffer(cp, F),
                  "logits": cp.zeros((1, self.n_vocab), cp.float32)}
        self.pf = PrefillScratch()                  # prefill buffers and the f16 weight scratch for cuBLAS
        self.short_crossover: int | None = None     # measure_short_read's result (settings.short_read's limit)

    def _attention_buffers(self) -> None:
        """The decode attention's buffers: Q|K|V, the attention output and its q8_1 blocks, the split-K partials
        and the merge counters (per KV head for v2, per head for v1)."""
        cp, H, KV, hd = self.cp, self.n_head, self.n_kv, self.hd
        nq = H * hd
        self.d.update({"qkv": cp.zeros((1, nq + 2 * KV * hd), cp.float32), "att": cp.zeros((1, nq), cp.float32),
                       "aq": q8_buffer(cp, nq),
                       "partial": cp.zeros(H * max(settings.MAX_SPLIT, settings.GQA_MAX_SPLIT) * (hd + 2), cp.float32),
                       "counters": cp.zeros(max(64, KV, H), cp.uint32)})

    @staticmethod
    def unsupported(model, lo: int = 0, hi: int | None = None) -> str | None:
        """Why the plan cannot run the carve [lo, hi) of `model` (one line), or None if it can."""
        raise NotImplementedError

    def layers(self) -> list:
        """The carve's layers (model.layers[lo:hi]; layer li of the model is layers()[li - lo])."""
        return self.model.layers[self.lo:self.hi]

    # ---- what a family's step is made of
    def _step_args(self, size_class: int) -> tuple:
        """The arguments of ``_enqueue_step`` for a step of this context-size class (its attention split)."""
        raise NotImplementedError

    def _enqueue_step(self, *args, graph: bool = False) -> None:
        """Enqueue one decode step on the current stream: only preallocated buffers, token / pos / len read from
        d['inp']. graph: the step is being captured (launches may read pos, len and the page table before their PDL
        wait)."""
        raise NotImplementedError

    def _inp(self) -> tuple[Any, Any, Any]:
        """int* to the token, the position and the length in d['inp']."""
        inp = self.d["inp"].data.ptr
        return tuple(ffi().cast("int *", inp + 4 * i) for i in range(3))

    def _qp(self, name: str) -> Any:
        """The q8_1 buffer `name` when the plan runs on int8 activations, else NULL (the kernels then skip it)."""
        return ptr(self.d[name]) if self.dp4a else ffi().NULL

    def _mv(self, s, groups, y, x, xq, n_in: int, long_rows: bool = False) -> None:
        """y[off:off + n_out] = W x for each (W, off, n_out) of groups: from the q8_1 blocks xq (written by the kernel
        that produced x) when the plan runs on int8 activations and W's type has the dp4a kernel, else from f32 x.
        long_rows (a llama down projection): one block per MV_BLOCK_ROWS rows (strata_matvec_q8b) from
        settings.MV_BLOCK_FROM sub-blocks per row."""
        lb = lib()
        for w, off, n_out in groups:
            if self.dp4a and lb.strata_matvec_q8_supported(w.ggml_type):
                if long_rows and self._block_rows(n_in):
                    check(lb.strata_matvec_q8b(s, w.ggml_type, ptr(w), ptr(xq), fptr(y, off), n_out, n_in,
                                               MV_BLOCK_ROWS), "strata_matvec_q8b")
                    continue
                check(lb.strata_matvec_q8w(s, w.ggml_type, ptr(w), ptr(xq), fptr(y, off), n_out, n_in,
                                           rows_per_warp(n_out)), "strata_matvec_q8w")
            else:
                check(lb.strata_matvec(s, w.ggml_type, ptr(w), ptr(x), fptr(y, off), n_out, n_in, 1), "strata_matvec")

    def _block_rows(self, n_in: int) -> bool:
        """Whether a long-row matvec (rows of n_in values) runs one block per MV_BLOCK_ROWS rows."""
        return bool(self.mv_block_from and n_in // 32 >= self.mv_block_from)

    def _embed_row(self, s, tok_p) -> None:
        """The first stage's input: the token's embedding row into d['x']."""
        if self.first:
            m = self.model
            check(lib().strata_get_rows(s, m.tok_embd.ggml_type, ptr(m.tok_embd), tok_p, ptr(self.d["x"]), 1,
                                        self.n_embd), "get_rows")

    def _norm(self, s, src, weight, residual=None, out="hn", sum_out=None) -> None:
        """d[out] = RMSNorm(src (+ residual)) * weight with its q8_1 blocks in d['hq'], src + residual written to
        sum_out (default: residual itself); out None: only that sum (the kernel reads the weight, writes no norm)."""
        NULL = ffi().NULL
        sum_out = residual if sum_out is None else sum_out
        q = self._qp("hq") if out else NULL
        check(lib().strata_rms_norm_ex(s, ptr(src), ptr(residual), ptr(weight), ptr(self.d[out]) if out else NULL,
                                       ptr(sum_out), NULL, q, 1, self.n_embd, self.eps), "rms_norm")

    def _ffn(self, s, gu_groups: list, w_down, glu, long_rows: bool = False) -> None:
        """The dense SwiGLU FFN of the normed row d['hn'] / d['hq'] into d['o']: SwiGLU inside the gate/up matvec
        (``glu``: glu_pointers) or gate/up matvecs into d['gu'] then strata_swiglu_gu (act and its q8_1 blocks),
        then the down matvec."""
        lb, d, E, F = lib(), self.d, self.n_embd, self.n_ff
        if glu is not None:
            check(lb.strata_matvec_q8w_glu(s, glu[0], addr(glu[1]), addr(glu[2]), self._qp("hq"),
                                           ptr(d["act"]), self._qp("fq"), F, E, glu_pairs_per_warp(F, self.n_sm)),
                  "matvec_glu")
        else:
            self._mv(s, gu_groups, d["gu"], d["hn"], d["hq"], E)
            check(lb.strata_swiglu_gu(s, ptr(d["gu"]), 1, F, ptr(d["act"]), ffi().NULL, self._qp("fq")), "swiglu_gu")
        self._mv(s, [(w_down, 0, E)], d["o"], d["act"], d["fq"], F, long_rows=long_rows)

    def _layer_end(self, s, li: int, own_norm, x=None) -> None:
        """After layer li's FFN: x (default d['x']) += d['o'] and the next layer's (or, ending the last stage, the
        final) norm into d['hn'] / d['hq']; a middle stage's last layer: only d['x'] = x + d['o'] (own_norm is read,
        nothing normed)."""
        m, d = self.model, self.d
        x = d["x"] if x is None else x
        end = li + 1 == self.hi
        if not end or self.last:
            self._norm(s, d["o"], m.out_norm if end else m.layers[li + 1].attn_norm, residual=x)
        else:
            self._norm(s, d["o"], own_norm, residual=x, out=None, sum_out=d["x"])

    def _head(self, s, tok_p, pos_p) -> None:
        """The step's end: on the last stage the output matvec of d['hn'] and the argmax into inp[0]; every stage
        advances the position and the length."""
        lb, d = lib(), self.d
        if self.last:
            self._mv(s, [(self.model.output, 0, self.n_vocab)], d["logits"], d["hn"], d["hq"], self.n_embd)
            check(lb.strata_argmax(s, ptr(d["logits"]), tok_p, 1, self.n_vocab), "argmax")
        check(lb.strata_add_scalar(s, pos_p, 1, 2), "add")

    # ---- the runner
    def _launch(self, length: int) -> None:
        """One step attending over `length` positions, on self.stream (graph replay or eager launches)."""
        cls = settings.size_class(length)
        args = self._step_args(cls)
        if not self.use_graphs:
            self._enqueue_step(*args)
            return
        g = self.graphs.get(cls)
        if g is None:
            self.stream.begin_capture()
            try:
                self._enqueue_step(*args, graph=True)
            finally:
                g = self.stream.end_capture()
            self.graphs[cls] = g
        g.launch(self.stream)

    def _check_state(self, state) -> None:
        """A family's own checks of a sequence before a step (changing nothing on error)."""

    def _attach(self, state) -> None:
        """A family's own set-up of a sequence before its step runs (on the current stream)."""

    def _begin(self, state, first: int, n: int) -> None:
        """Checks (changing nothing on error), kv.reserve(n), the family's set-up, the page table and inp = [first,
        pos, pos + 1], ordered after the current stream's work."""
        check_sequence(self.pool, state)
        kv = state.kv
        if not 0 <= first < self.n_vocab:
            raise ValueError(f"token id out of range [0, {self.n_vocab})")
        self._check_state(state)
        kv.reserve(n)                                         # KVCacheFull here changes nothing
        self._attach(state)
        self.stream.wait_event(self.cp.cuda.get_current_stream().record())
        with self.stream:
            self.pool.table(kv.pages)
            self.d["inp"].set(np.asarray([first, state.pos, state.pos + 1], dtype=np.int32), stream=self.stream)

    def decode_device(self, token: int, state, x_in=None):
        """model.forward([token], state) through the plan, logits left on the device: a CuPy f32 (n_vocab,) view of
        the plan's logits buffer (valid until the next step), ordered on the current stream. A carve: x_in, the
        hidden state a stage after the first starts from (CuPy f32, n_embd elements, on the plan's device), is
        copied in before the step; a stage before the last returns its hidden state instead of logits, a CuPy f32
        (1, n_embd) view of the plan's residual-stream buffer (valid until the next step)."""
        token = int(token)
        x = hidden_input(x_in, 1, self.n_embd, self.first, self.model.backend.device_id)
        self._begin(state, token, 1)
        with self.stream:
            if x is not None:
                self.d["x"][...] = x         # outside the graph, which reads d['x']
            self._launch(state.pos + 1)
        self.cp.cuda.get_current_stream().wait_event(self.stream.record())
        state.kv.commit(1)
        state.advance([token])
        return self.d["logits"][0] if self.last else self.d["x"][:1]

    def decode(self, token: int, state, x_in=None):
        """model.forward([token], state) through the plan -> f32 logits (n_vocab,) on the host; a stage before the
        last: its hidden state, a CuPy f32 (1, n_embd) copy (decode_device)."""
        out = self.decode_device(token, state, x_in)
        return self.cp.asnumpy(out) if self.last else out.copy()

    def decode_greedy(self, first_token: int, n: int, state) -> list[int]:
        """Feed first_token at state.pos, then n - 1 device-argmax tokens; returns the n argmax tokens chosen.
        The sequence advances by n (first_token and the first n - 1 chosen). The whole model only (no carve)."""
        if not (self.first and self.last):
            raise ValueError(f"decode_greedy runs the whole model, not the carve [{self.lo}, {self.hi})")
        if n < 1:
            return []
        first_token = int(first_token)
        self._begin(state, first_token, n)
        cp = self.cp
        p0 = state.pos
        with self.stream:
            out = cp.zeros(n, cp.int32)
            for i in range(n):
                self._launch(p0 + i + 1)
                out[i:i + 1] = self.d["inp"][0:1]
            got = [int(t) for t in cp.asnumpy(out, stream=self.stream)]
        cp.cuda.get_current_stream().wait_event(self.stream.record())
        state.kv.commit(n)
        state.advance([first_token] + got[:-1])
        return got

    def logits(self) -> np.ndarray:
        """Logits of the last step (host f32 (n_vocab,))."""
        return self.cp.asnumpy(self.d["logits"][0], stream=self.stream)

    # ---- the short read: n <= SHORT_READ_COLS new tokens of one sequence as the decode step over n columns
    def short_form(self) -> str | None:
        """The decode form the short read mirrors over columns (a family's name for it), or None: the plan's decode
        step has kernels the column launchers do not mirror, and a short read runs decode steps one token at a
        time (the same bits, the weights read once per token)."""
        return None

    def _enqueue_short(self, form: str, n: int, rows: tuple, all_logits: bool, graph: bool = False) -> None:
        """Enqueue the short read of n columns in `form` on the current stream: only the buffers of ``self.c``,
        tokens / positions / lengths read from c['inp']; rows[i] the ``_step_args`` of row i's context-size class
        (its attention split, as the decode step of that row has it)."""
        raise NotImplementedError

    def _short_buffers(self) -> dict:
        """The short read's buffers at fixed addresses for SHORT_READ_COLS columns (made on first use; graphs read
        them): ``inp`` = [tokens | positions | lengths] (int32, SHORT_READ_COLS each) and, per name of ``self.d``,
        the same buffer with one row per column (q8_1 ones in strata_q8_col_bytes columns; the attention's split
        partials and counters a row each)."""
        c = getattr(self, "c", None)
        if c is not None:
            return c
        cp, C = self.cp, settings.SHORT_READ_COLS
        self.c = c = {"inp": cp.zeros(3 * C, cp.int32)}
        self.cstride: dict[str, int] = {}
        for name, a in self.d.items():
            if name in ("inp", "hcnt", "keep"):
                continue
            if a.dtype == cp.uint8:            # a q8_1 buffer of n values: n + n / 4 bytes
                nb = int(lib().strata_q8_col_bytes(a.size * 4 // 5))
                c[name] = cp.zeros((C, nb if nb > 0 else -(-a.size // 16) * 16), cp.uint8)   # n % 32: unused
            elif name in ("partial", "counters"):   # attention: each row's split partials and merge counters
                c[name] = cp.zeros((C, a.size), a.dtype)
            else:
                c[name] = cp.zeros((C,) + tuple(a.shape[1:] if a.ndim > 1 else a.shape), a.dtype)
            self.cstride[name] = c[name].strides[0]
        if "hcnt" in self.d:        # the norm handoff's counters: shared by the columns (one block does them all)
            c["hcnt"] = self.d["hcnt"]
        return c

    def _col(self, name: str, i: int) -> Any:
        """void * to column i of the short read's buffer `name`."""
        return addr(self.c[name].data.ptr + i * self.cstride[name])

    def _col_q(self, name: str, i: int) -> Any:
        """Column i of the q8_1 buffer `name` when the plan runs on int8 activations, else NULL (_qp's rule)."""
        return self._col(name, i) if self.dp4a else ffi().NULL

    def _rows_inp(self, i: int) -> tuple[Any, Any, Any]:
        """int * to row i's token, position and length in c['inp']."""
        base, C = self.c["inp"].data.ptr, settings.SHORT_READ_COLS
        return tuple(ffi().cast("int *", base + 4 * (k * C + i)) for k in range(3))

    def _cols_mv(self, s, groups, y: str, x: str, xq: str, n_in: int, n: int, first: int = 0,
                 long_rows: bool = False) -> None:
        """_mv over columns first .. n - 1 of the short read's buffers (y, x, xq: names in self.c): the column
        launchers where _mv runs strata_matvec_q8w / _q8b, else _mv's strata_matvec one column at a time."""
        lb, c = lib(), self.c
        ys = c[y].shape[1]
        nc = n - first
        for w, off, n_out in groups:
            if self.dp4a and lb.strata_matvec_q8_supported(w.ggml_type):
                yp = addr(c[y].data.ptr + first * self.cstride[y] + 4 * off)
                xp = self._col(xq, first)
                if long_rows and self._block_rows(n_in):
                    check(lb.strata_mvc_q8b(s, w.ggml_type, ptr(w), xp, yp, ys, n_out, n_in, nc), "strata_mvc_q8b")
                else:
                    check(lb.strata_mvc_q8w(s, w.ggml_type, ptr(w), xp, yp, ys, n_out, n_in, nc), "strata_mvc_q8w")
            else:
                for i in range(first, n):
                    check(lb.strata_matvec(s, w.ggml_type, ptr(w), self._col(x, i),
                                           addr(c[y].data.ptr + i * self.cstride[y] + 4 * off), n_out, n_in, 1),
                          "strata_matvec")

    def _cols_norm(self, s, n: int, src: str, weight, residual: str | None = None, out: str | None = "hn",
                   sum_out: str | None = None) -> None:
        """_norm over the n columns in one launch (strata_rms_norm_rows: each row as strata_rms_norm_ex on it; rows
        wider than 8192 with q8_1 blocks: strata_rms_norm_ex one row at a time)."""
        NULL = ffi().NULL
        sum_out = residual if sum_out is None else sum_out
        if self.n_embd > 8192 and out and self.dp4a:
            for i in range(n):
                check(lib().strata_rms_norm_ex(s, self._col(src, i), self._col(residual, i) if residual else NULL,
                                               ptr(weight), self._col(out, i), self._col(sum_out, i) if sum_out else
                                               NULL, NULL, self._col_q("hq", i), 1, self.n_embd, self.eps),
                      "rms_norm")
            return
        check(lib().strata_rms_norm_rows(s, self._col(src, 0), self._col(residual, 0) if residual else NULL,
                                         ptr(weight), self._col(out, 0) if out else NULL,
                                         self._col(sum_out, 0) if sum_out else NULL,
                                         self._col_q("hq", 0) if out else NULL, self.cstride["hq"], n, self.n_embd,
                                         self.eps), "rms_norm_rows")

    def _cols_ffn(self, s, n: int, gu_groups: list, w_down, glu, long_rows: bool = False) -> None:
        """_ffn over the columns: SwiGLU in the gate/up column launcher, or the gate/up matvecs and
        strata_swiglu_gu_rows; then the down matvec into c['o']."""
        lb, E, F = lib(), self.n_embd, self.n_ff
        if glu is not None:
            check(lb.strata_mvc_q8w_glu(s, glu[0], addr(glu[1]), addr(glu[2]), self._col("hq", 0),
                                        self._col("act", 0), self._col("fq", 0), F, E, n, self.eps, ffi().NULL),
                  "mvc_glu")
        else:
            self._cols_mv(s, gu_groups, "gu", "hn", "hq", E, n)
            check(lb.strata_swiglu_gu_rows(s, self._col("gu", 0), n, F, self._col("act", 0), self._col_q("fq", 0),
                                           self.cstride["fq"]), "swiglu_gu_rows")
        self._cols_mv(s, [(w_down, 0, E)], "o", "act", "fq", F, n, long_rows=long_rows)

    def _cols_layer_end(self, s, n: int, li: int, own_norm) -> None:
        """_layer_end per column: x += o and the next (or final) norm; a middle stage's last layer only the sum."""
        m = self.model
        end = li + 1 == self.hi
        if not end or self.last:
            self._cols_norm(s, n, "o", m.out_norm if end else m.layers[li + 1].attn_norm, residual="x")
        else:
            self._cols_norm(s, n, "o", own_norm, residual="x", out=None, sum_out="x")

    def _cols_embed(self, s, n: int) -> None:
        """The first stage's input: the n tokens' embedding rows into c['x']."""
        if self.first:
            m = self.model
            check(lib().strata_get_rows(s, m.tok_embd.ggml_type, ptr(m.tok_embd), self._rows_inp(0)[0],
                                        ptr(self.c["x"]), n, self.n_embd), "get_rows")

    def _cols_head(self, s, n: int, all_logits: bool) -> None:
        """The last stage's output matvec of c['hn'] / c['hq'] into c['logits']: every column with all_logits,
        else only the last."""
        if self.last:
            self._cols_mv(s, [(self.model.output, 0, self.n_vocab)], "logits", "hn", "hq", self.n_embd, n,
                          first=0 if all_logits else n - 1)

    def _cols_attn_rows(self, s, li: int, rows: tuple, q: str, out: str, out_q8: str | None,
                        tables: tuple[int, int] | None = None) -> None:
        """Decode attention of every row over layer li's pages (c[q] the rows' query rows, c[out] / c[out_q8] their
        outputs), one launch per run of rows with the same step arguments: each row with the kernel (v2: the GQA
        one) and split of its own decode step, its own length, partials and counters (strata_attn_rows(_gqa)).
        tables: (device address, stride in entries) of one page table per row (a batched step's sequences); None:
        the pool's one table (one sequence's rows)."""
        lb, c, pool = lib(), self.c, self.pool
        H, KV, hd = self.n_head, self.n_kv, self.hd
        slot = pool.slot(li)
        kc, vc = pool.k[slot], pool.v[slot]
        ks, vs = pool.scales(slot)
        qs, os_ = c[q].shape[1], c[out].shape[1]
        q8s = self.cstride[out_q8] if out_q8 else 0
        ws, cs = c["partial"].shape[1], c["counters"].shape[1]
        i0 = 0
        while i0 < len(rows):
            i1 = i0 + 1
            while i1 < len(rows) and rows[i1] == rows[i0]:
                i1 += 1
            n_split, v2 = rows[i0][0], self._row_v2(rows[i0])
            ctr = ffi().cast("unsigned *", c["counters"].data.ptr + i0 * self.cstride["counters"])
            oq = self._col_q(out_q8, i0) if out_q8 else ffi().NULL
            pt = (ptr(pool._pt), 0) if tables is None else (addr(tables[0] + 4 * i0 * tables[1]), tables[1])
            args = (self._col(q, i0), qs, ptr(kc), ptr(vc), *pt, self._rows_inp(i0)[2])
            if v2:
                check(lb.strata_attn_rows_gqa(s, *args, self._col("partial", i0), ws, ctr, cs, self._col(out, i0), os_,
                                              oq, q8s, i1 - i0, H, KV, hd, pool.page_size, n_split, self.scale,
                                              ptr(ks), ptr(vs)), "attn_rows_gqa")
            else:
                check(lb.strata_attn_rows(s, *args, self._col("partial", i0), ws, self._col(out, i0), os_, oq, q8s,
                                          ctr, cs, i1 - i0, H, KV, hd, pool.page_size, n_split, self.scale),
                      "attn_rows")
            i0 = i1

    def _cols_rope_kv(self, s, n: int, q: str, kc, vc, ks, vs, neox: int,
                      tables: tuple[int, int] | None = None) -> None:
        """RoPE of every row of c[q] at its position and its K / V into the pages (strata_rope_kv_rows; a q8_0
        cache: RoPE only, then strata_kv_write_q8 of the rows, which sit at consecutive positions). tables: one page
        table per row (_cols_attn_rows'; a batched step's sequences): each row through the decode step's own
        launches (strata_rope_kv_decode, and strata_kv_write_q8 of its one row)."""
        lb, c, pool = lib(), self.c, self.pool
        H, KV, hd = self.n_head, self.n_kv, self.hd
        W, NULL = c[q].shape[1], ffi().NULL
        q8 = ks is not None
        if tables is not None:
            for i in range(n):
                pt, pos = addr(tables[0] + 4 * i * tables[1]), self._rows_inp(i)[1]
                check(lb.strata_rope_kv_decode(s, self._col(q, i), pos, NULL if q8 else ptr(kc),
                                               NULL if q8 else ptr(vc), pt, H, KV, hd, self.n_rot, self.theta, neox,
                                               pool.page_size), "rope_kv_decode")
                if q8:
                    base = c[q].data.ptr + i * self.cstride[q] + 4 * H * hd
                    check(lb.strata_kv_write_q8(s, addr(base), W, addr(base + 4 * KV * hd), W, ptr(kc), ptr(vc),
                                                ptr(ks), ptr(vs), pt, pos, 0, 1, KV, hd, pool.page_size),
                          "kv_write_q8")
            return
        check(lb.strata_rope_kv_rows(s, self._col(q, 0), W, self._rows_inp(0)[1], NULL if q8 else ptr(kc),
                                     NULL if q8 else ptr(vc), ptr(pool._pt), n, H, KV, hd, self.n_rot, self.theta,
                                     neox, pool.page_size), "rope_kv_rows")
        if q8:
            base = c[q].data.ptr + 4 * H * hd
            check(lb.strata_kv_write_q8(s, addr(base), W, addr(base + 4 * KV * hd), W, ptr(kc), ptr(vc), ptr(ks),
                                        ptr(vs), ptr(pool._pt), self._rows_inp(0)[1], 0, n, KV, hd, pool.page_size),
                  "kv_write_q8")

    @staticmethod
    def _row_v2(args: tuple) -> bool:
        """Whether a row's step arguments (``_step_args``) take the GQA decode attention kernel (a family's
        override: llama's second element; the hybrid always)."""
        return True

    def _short_rows(self, p0: int, n: int) -> tuple:
        """rows of _enqueue_short: each row's decode step arguments (its context-size class's attention split)."""
        return tuple(self._step_args(settings.size_class(p0 + i + 1)) for i in range(n))

    def _launch_short(self, form: str, n: int, p0: int, all_logits: bool) -> None:
        """The short read of n columns at positions p0.. on self.stream (a graph per (form, n, rows, all_logits),
        captured on first use, at most settings.SHORT_READ_GRAPHS of them kept, or eager launches)."""
        rows = self._short_rows(p0, n)
        if not self.use_graphs:
            self._enqueue_short(form, n, rows, all_logits)
            return
        key = ("short", form, n, rows, bool(all_logits))
        g = self.graphs.pop(key, None)
        if g is None:
            self.stream.begin_capture()
            try:
                self._enqueue_short(form, n, rows, all_logits, graph=True)
            finally:
                g = self.stream.end_capture()
            short = [k for k in self.graphs if isinstance(k, tuple) and k[0] == "short"]
            for k in short[:max(0, len(short) + 1 - settings.SHORT_READ_GRAPHS)]:
                del self.graphs[k]        # the least recently used short-read graphs beyond the bound
        self.graphs[key] = g              # (re)inserted last: the dict's order is the use order
        g.launch(self.stream)

    def short_read(self, tokens, state, all_logits: bool = False, x_in=None, hidden: bool = False,
                   device: bool = False):
        """model.forward(tokens, state, all_logits) for 1..SHORT_READ_COLS tokens as the decode step over that many
        columns (``short_form``; None: decode steps one token at a time): row i's logits, K/V and running state
        are bit for bit those of decoding token i after rows 0..i-1. Same errors as the prefill (ValueError for an
        empty or too long batch, a bad token, a foreign pool, a KV length mismatch, the family's own; KVCacheFull
        from kv.reserve; each changing nothing) and bookkeeping. Returns host f32 logits (n_vocab,) of the last
        token or (n, n_vocab) with all_logits; a stage before the last its hidden states, a CuPy f32 (n, n_embd)
        array of its own. A stage after the first starts from x_in (CuPy f32 (n, n_embd)). hidden (the last
        stage): (those logits, the final-normed rows, CuPy f32 (n, n_embd) of its own). device (the last stage):
        the logits left on the device, a CuPy f32 view of the plan's logits buffer (valid until the next read),
        ordered on the current stream, instead of a host copy.

        A sequence armed by Memory.keep (``state.steps``: a speculative verify) also gets the running state after
        each row written into its kept slots (``_keep_table``), on the device, in the same launches."""
        cp = self.cp
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = int(toks.shape[0])
        if not 1 <= n <= settings.SHORT_READ_COLS:
            raise ValueError(f"a short read takes 1 to {settings.SHORT_READ_COLS} tokens (got {n})")
        if int(toks.min()) < 0 or int(toks.max()) >= self.n_vocab:
            raise ValueError(f"token id out of range [0, {self.n_vocab})")
        x = hidden_input(x_in, n, self.n_embd, self.first, self.model.backend.device_id)
        check_sequence(self.pool, state)
        self._check_state(state)
        kv = state.kv
        self._check_keep(state, n)
        kv.reserve(n)                                         # KVCacheFull here changes nothing
        form = self._form()
        if form is None:
            return self._short_by_steps(toks, state, all_logits, x, hidden, device)
        self._attach(state)
        c = self._short_buffers()
        C, p0 = settings.SHORT_READ_COLS, int(state.pos)
        inp = np.zeros(3 * C, np.int32)
        inp[:n] = toks
        inp[C:C + n] = p0 + np.arange(n)
        inp[2 * C:2 * C + n] = p0 + 1 + np.arange(n)
        self.stream.wait_event(cp.cuda.get_current_stream().record())
        with self.stream:
            self.pool.table(kv.pages)
            c["inp"].set(inp, stream=self.stream)
            if x is not None:
                c["x"][:n] = x
            self._keep_table(state)
            self._launch_short(form, n, p0, all_logits)
            if self.last:
                out = c["logits"][:n] if all_logits else c["logits"][n - 1]
                res = out if device else cp.asnumpy(out, stream=self.stream)
                if hidden:
                    res = (res, c["hn"][:n].copy())
            else:
                res = c["x"][:n].copy()
        cp.cuda.get_current_stream().wait_event(self.stream.record())
        kv.commit(n)
        state.advance(toks)
        return res

    # ---- a speculative verify's kept states (Memory.keep arms state.steps)
    def _check_keep(self, state, n: int) -> None:
        """ValueError (changing nothing) when `state` is armed to keep its states (``state.steps``) at another
        position or for fewer than n tokens."""
        steps = state.steps
        if steps is not None and (steps.base != state.pos or steps.n < n):
            raise ValueError(f"the kept states are armed for {steps.n} tokens at {steps.base}, the read takes {n} "
                             f"at {state.pos}")

    def _keep_table(self, state) -> None:
        """Point the short read's keep launches at `state`'s kept slots (state.steps), or at none (enqueued on the
        current stream, before the launches that read it). A family with running state overrides it."""

    def _keep_steps(self, state, i: int) -> None:
        """After decode step i of a short read by steps: the running state into `state`'s kept slot i (a family with
        running state overrides it)."""

    def _form(self) -> str | None:
        """short_form(), asked once per plan: the form follows from the model's weights, the cache type and the
        settings, none of which change under a plan (asking walks every layer: ~0.3 ms a read on a 30-layer model)."""
        if not hasattr(self, "_short_form"):
            self._short_form = self.short_form()
        return self._short_form

    def takes_short_read(self, n: int) -> bool:
        """Whether a forward of n new tokens goes through ``short_read`` rather than the prefill: a column form and
        settings.short_read with this plan's crossover."""
        return self._form() is not None and settings.short_read(n, self.short_crossover)

    def measure_short_read(self, state, reps: int = 2) -> int | None:
        """Measure this plan's crossover (model, carve, GPU) and keep it as ``short_crossover``: the largest n in
        2..SHORT_READ_COLS up to which a short read of n tokens at state's position took less time than the prefill
        of the same tokens (1: none; sizes from 2 up, until the prefill is as fast), each the best of `reps`
        host-timed reads after a first one (which captures the short read's graph of that size). The state is
        captured first and restored after every read (it is left as it was). Returns the crossover, or None where
        there is nothing to choose (no column form, no prefill, a carve that is not the whole model)."""
        if self._form() is None or not self.takes_prefill(2) or not (self.first and self.last):
            return None
        rng = np.random.default_rng(0)
        snap = state.capture()
        sync = self.cp.cuda.Device().synchronize

        def best(run) -> float:
            t = float("inf")
            for _ in range(reps + 1):
                state.restore(snap)
                sync()
                t0 = time.perf_counter()
                run()
                sync()
                t = min(t, time.perf_counter() - t0)
            return t
        cross = 1
        try:
            for n in range(2, settings.SHORT_READ_COLS + 1):
                toks = rng.integers(0, self.n_vocab, n).astype(np.int32)
                if best(lambda: self.short_read(toks, state)) >= best(lambda: self.prefill(toks, state)):
                    break
                cross = n
        finally:
            state.restore(snap)
        self.short_crossover = cross
        return cross

    def _short_by_steps(self, toks, state, all_logits: bool, x, hidden: bool = False, device: bool = False):
        """short_read without a column form: one decode step per token (the pages already reserved; an armed
        sequence's running state copied into its kept slot after each); device: the logits left on the device."""
        cp, n = self.cp, int(toks.shape[0])
        outs, hs = [], []
        for i in range(n):
            out = self.decode_device(int(toks[i]), state, None if x is None else x[i:i + 1])
            if not self.last or all_logits or i == n - 1:
                outs.append(out.copy())
            if hidden and self.last:
                hs.append(self.d["hn"][0].copy())
            if state.steps is not None:
                self._keep_steps(state, i)
        if not self.last:
            return cp.concatenate(outs)
        res = cp.stack(outs) if all_logits else outs[-1]
        res = res if device else cp.asnumpy(res)
        return (res, cp.stack(hs)) if hidden else res

    # ---- prefill
    def takes_prefill(self, n: int) -> bool:
        """Whether ``prefill`` runs a forward of n > 1 tokens (else the model's own forward does)."""
        return False

    def _prefill_begin(self, tokens, state, x_in):
        """A prefill's checks (changing nothing on error: an empty batch, a bad token, a foreign pool, a KV length
        mismatch, the family's own; KVCacheFull from kv.reserve) and its input -> (token ids int32 (n,), the
        residual stream x, CuPy f32 (n, n_embd) in the plan's scratch: the embedding rows, or x_in on a later
        stage)."""
        cp, m = self.cp, self.model
        toks = np.asarray(tokens, dtype=np.int32).reshape(-1)
        n = int(toks.shape[0])
        if n == 0:
            raise ValueError("forward() needs at least one token")
        if int(toks.min()) < 0 or int(toks.max()) >= self.n_vocab:
            raise ValueError(f"token id out of range [0, {self.n_vocab})")
        x_in = hidden_input(x_in, n, self.n_embd, self.first, m.backend.device_id)
        check_sequence(self.pool, state)
        self._check_state(state)
        state.kv.reserve(n)                                   # KVCacheFull here changes nothing
        x = self.pf.buf("x", (n, self.n_embd), cp.float32)
        if self.first:
            ids = self.pf.buf("ids", (n,), cp.int32)
            ids.set(toks)
            check(lib().strata_get_rows(stream_ptr(), m.tok_embd.ggml_type, ptr(m.tok_embd), ptr(ids), ptr(x), n,
                                        self.n_embd), "get_rows")
        else:
            x[...] = x_in
        return toks, x

    def _prefill_norm(self, s, x, weight, h16) -> None:
        """h16 (f16 (n, n_embd)) = RMSNorm(x) * weight over the n rows of x."""
        NULL = ffi().NULL
        n = x.shape[0]
        check(lib().strata_rms_norm_ex(s, ptr(x), NULL, ptr(weight), NULL, NULL, ptr(h16), NULL, n, self.n_embd,
                                       self.eps), "rms_norm")

    def _prefill_ffn_buffers(self, n: int):
        """The FFN's scratch for n rows: the gate|up f32 output and the f16 activations (made once per prefill)."""
        cp, pf = self.cp, self.pf
        return pf.buf("gu", (n, 2 * self.n_ff), cp.float32), pf.buf("act16", (n, self.n_ff), cp.float16)

    def _prefill_ffn(self, s, x, norm, gu_groups: list, w_down, h16, gu, act16) -> None:
        """x += down(SwiGLU(gate|up(RMSNorm(x) * norm))) over the n rows of x: the gate|up GEMMs (one per group, into
        its columns of gu), strata_swiglu_gu writing act16, the down GEMM adding into x (beta = 1)."""
        pf, n, F = self.pf, x.shape[0], self.n_ff
        self._prefill_norm(s, x, norm, h16)
        for w, off, _ in gu_groups:
            pf.gemm(h16, w, gu, False, off)
        NULL = ffi().NULL
        check(lib().strata_swiglu_gu(s, ptr(gu), n, F, NULL, ptr(act16), NULL), "swiglu")
        pf.gemm(act16, w_down, x, True)

    def _prefill_end(self, x, toks, state, all_logits: bool, hidden: bool = False):
        """The prefill's result (host logits on the last stage, with hidden (logits, the final-normed rows); else a
        copy of the hidden states: x is scratch) and the sequence's bookkeeping (pages committed, tokens
        recorded)."""
        out = prefill_logits(self.model, x, all_logits, self.eps, hidden) if self.last else x.copy()
        state.kv.commit(int(toks.shape[0]))
        state.advance(toks)
        return out


class PlanModel:
    """What the engine runs on CUDA: the model itself (every attribute, everything the plan does not take), except
    that on a CudaPagePool sequence a one-token forward goes through the family's DecodePlan (its captured graph)
    and a long one through the plan's prefill (``takes_prefill``), one plan per pool. ``plan_class`` names the
    family's plan.

    lo, hi: the carve, layers [lo, hi) (hi None: to the last block) that this stage runs (its plans are made with
    it); a stage after the first takes the previous stage's hidden states (x_in), a stage before the last returns
    its own (CuPy f32 (n, n_embd)) instead of logits."""

    plan_class: ClassVar[type[DecodePlan]] = DecodePlan
    device_logits = True        # forward_device leaves the last token's logits on the device

    def __init__(self, model, lo: int = 0, hi: int | None = None):
        self.model = model
        self.lo, self.hi = carve_bounds(lo, hi, model.n_blocks)
        self.plans: dict[int, DecodePlan] = {}
        self.prefill = self.prefill_enabled()        # long forwards through the plan's prefill (where it takes them)

    @staticmethod
    def prefill_enabled() -> bool:
        """Whether this family's long forwards may go through its plan's prefill (read when the wrapper is made)."""
        return True

    def __getattr__(self, name):
        return getattr(self.model, name)

    def new_page_pool(self, *args, **kwargs):
        """The model's page pool, with this pool's plan made at once (its buffers and fused weight copies are
        allocated when the engine loads the model, so a device that cannot hold them fails then, not at the first
        decode token)."""
        pool = self.model.new_page_pool(*args, **kwargs)
        if isinstance(pool, CudaPagePool):
            with self.model.backend.device:
                self.plan(pool)
        return pool

    def plan(self, pool) -> DecodePlan:
        """The plan of `pool` (made on first use)."""
        p = self.plans.get(id(pool))
        if p is None or p.pool is not pool:
            p = self.plans[id(pool)] = self.plan_class(self.model, pool, lo=self.lo, hi=self.hi)
        return p

    def generic_forward(self, tokens, state, all_logits: bool = False, x_in=None):
        """The model's own forward of this carve (host logits for the last stage, the hidden states on the device
        before it)."""
        return self.model.forward_carve(tokens, state, self.lo, self.hi, x_in=x_in, all_logits=all_logits)

    def _on_plan(self, state) -> bool:
        return state.kv is not None and isinstance(state.kv.pool, CudaPagePool)

    def forward(self, tokens, state, all_logits: bool = False, x_in=None, hidden: bool = False):
        """The model's forward (same arguments, result and errors), on the backend's device in any thread: one token
        (without all_logits) through the plan's decode step, 2 tokens up to the plan's crossover through its short
        read (DecodePlan.takes_short_read) where the plan mirrors its step over columns (short_form), a longer
        forward through its prefill where the plan takes it, everything else the model's own forward
        (generic_forward).

        A read that wants every row's logits or keeps every row's state (a speculative verify: all_logits, or
        ``state.steps`` armed by Memory.keep) of at most SHORT_READ_COLS tokens always takes the short read, whose
        rows are bit for bit decode steps (so ``--spec N`` emits what ``--spec 0`` does). hidden (the last stage):
        (logits, the final-normed hidden states of every row, CuPy f32 (n, n_embd)), for the MTP drafter."""
        toks = np.asarray(tokens).reshape(-1)
        n = int(toks.shape[0])
        with self.model.backend.device:
            # a read keeping running states at its checkpoints' rows (Memory.mark) goes through the plan's prefill,
            # which splits its state-carrying launches there, else the model's own forward (the decode step and the
            # short read's graphs keep none)
            marked = bool(state.running) and state.steps is None and any(0 < p - state.pos < n for p in
                                                                         (state.marks.at if state.marks else ()))
            if marked and self._on_plan(state):
                plan = self.plan(state.kv.pool)
                if self.prefill and plan.takes_prefill(n):
                    if hidden and plan.last:
                        return plan.prefill(tokens, state, all_logits, x_in, hidden=True)
                    return plan.prefill(tokens, state, all_logits, x_in)
            elif self._on_plan(state):
                plan = self.plan(state.kv.pool)
                verify = (all_logits or state.steps is not None) and n <= settings.SHORT_READ_COLS
                if n == 1 and not verify:
                    if hidden and plan.last:
                        logits = plan.decode(token_id(toks[0], self.model.config.n_vocab), state, x_in)
                        return logits, plan.d["hn"][:1].copy()
                    return plan.decode(token_id(toks[0], self.model.config.n_vocab), state, x_in)
                if verify or plan.takes_short_read(n):
                    return plan.short_read(tokens, state, all_logits, x_in, hidden=hidden and plan.last)
                if n > 1 and self.prefill and plan.takes_prefill(n):
                    if hidden and plan.last:
                        return plan.prefill(tokens, state, all_logits, x_in, hidden=True)
                    return plan.prefill(tokens, state, all_logits, x_in)
            if state.steps is not None:
                return self._verify_by_steps(toks, state, all_logits, x_in, hidden)
            if hidden and self.model.ends_with_head(self.hi):
                return self.model.forward_carve(tokens, state, self.lo, self.hi, x_in=x_in, all_logits=all_logits,
                                                hidden=True)
            return self.generic_forward(tokens, state, all_logits, x_in)

    def _verify_by_steps(self, toks, state, all_logits: bool, x_in, hidden: bool):
        """forward() of a sequence armed by Memory.keep that is not on the plan (a carve without attention layers
        has no pages, so no plan): the tokens read one at a time through the model's own forward (each row the
        bits of that forward's one-token read), the running state after each copied into its kept slot on the
        device. Same result as forward()."""
        steps, cp = state.steps, self.model.backend.cp
        head = self.model.ends_with_head(self.hi)
        outs, hs = [], []
        state.steps = None
        try:
            for i in range(toks.shape[0]):
                xi = None if x_in is None else x_in[i:i + 1]
                if hidden and head:
                    o, h = self.model.forward_carve(toks[i:i + 1], state, self.lo, self.hi, x_in=xi,
                                                    all_logits=all_logits, hidden=True)
                    hs.append(h)
                else:
                    o = self.generic_forward(toks[i:i + 1], state, all_logits, xi)
                outs.append(o)
                for li, d in steps.layers.items():
                    for k, a in d.items():
                        a[i][...] = state.running[li][k]
        finally:
            state.steps = steps
        if head and not all_logits:
            out = outs[-1]
        else:
            xp = np if isinstance(outs[0], np.ndarray) else cp
            out = xp.concatenate([xp.asarray(o).reshape(1, -1) for o in outs])
        return (out, cp.concatenate([cp.asarray(h).reshape(1, -1) for h in hs])) if hidden and head else out

    def forward_batch(self, tokens, states, x_in=None, hidden: bool = False, on_device: bool = False):
        """One decode step of several sequences (Model.forward_batch's contract, hidden included: the final-normed
        rows the MTP drafters read; on_device: the logits as CuPy f32 (N, n_vocab) of their own) through the plan's
        decode step over columns (strata/backend/cuda/batch.py), lone decode steps where the plan has no column
        form."""
        from strata.backend.cuda.batch import forward_batch
        m = self.model
        with m.backend.device:
            x = hidden_input(x_in, len(states), m.config.n_embd, self.lo == 0, m.backend.device_id)
        return forward_batch(self, tokens, states, x, hidden=hidden, on_device=on_device)

    def measure_short_read(self, state) -> int | None:
        """The plan's crossover between the short read and the prefill, measured on `state` (left as it was) and
        kept by the plan (DecodePlan.measure_short_read); None for a sequence not on a plan or nothing to choose."""
        if not self._on_plan(state):
            return None
        with self.model.backend.device:
            return self.plan(state.kv.pool).measure_short_read(state)

    def forward_device(self, tokens, state, x_in=None, hidden: bool = False, all_logits: bool = False):
        """forward(tokens, state, x_in=x_in) with the last token's logits left on the device: CuPy f32 (n_vocab,),
        ordered on the current stream (valid until the next call); a stage before the last: its hidden states, CuPy
        f32 (n, n_embd). hidden (the last stage): (those logits, the final-normed rows, CuPy f32 (n, n_embd) of
        its own), for the MTP drafter. all_logits: every row's logits, CuPy f32 (n, n_vocab): a verify whose rows
        are judged on the device (the short read's rows left where they are; a read the plan does not take as a
        short read: forward()'s rows, copied to the device)."""
        toks = np.asarray(tokens).reshape(-1)
        cp = self.model.backend.cp
        with self.model.backend.device:
            if all_logits:
                if self._on_plan(state) and toks.shape[0] <= settings.SHORT_READ_COLS:
                    plan = self.plan(state.kv.pool)
                    return plan.short_read(tokens, state, True, x_in, hidden=hidden and plan.last, device=True)
                out = self.forward(tokens, state, all_logits=True, x_in=x_in, hidden=hidden)
                if not self.model.ends_with_head(self.hi):
                    return out
                return (cp.asarray(out[0]), out[1]) if hidden else cp.asarray(out)
            if toks.shape[0] == 1 and self._on_plan(state) and state.steps is None:
                plan = self.plan(state.kv.pool)
                out = plan.decode_device(token_id(toks[0], self.model.config.n_vocab), state, x_in)
                return (out, plan.d["hn"][:1].copy()) if hidden and plan.last else out
            if hidden and self.model.ends_with_head(self.hi):
                logits, h = self.forward(tokens, state, x_in=x_in, hidden=True)
                return cp.asarray(logits), h
            return cp.asarray(self.forward(tokens, state, x_in=x_in))   # hidden: as it is
