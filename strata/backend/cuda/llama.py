"""How strata/models/llama.py's layers execute on a GPU: LlamaCuda, the llama family's DecodePlan (fused decode
kernels in one captured graph per context-size class; prefill through cuBLAS and FlashAttention-2)."""
from __future__ import annotations

from strata.backend.cuda import settings
from strata.backend.cuda.library import addr, check, ffi, fptr, lib, ptr, stream_ptr
from strata.backend.cuda.runner import DecodePlan, PlanModel
from strata.backend.cuda.settings import (AUTO_V2_FROM, FLASH_HEAD_DIMS, FUSED_NORM_R, HANDOFF_R, MV_BLOCK_ROWS,
                                          fa2_splits, glu_pairs_per_warp, gqa_resident, n_split_class, n_split_for,
                                          rows_per_warp)
from strata.backend.cuda.weights import DeviceWeight, glu_pointers


class LlamaCuda(DecodePlan):
    """The llama family's layers as fused launches. It owns no weights and no model definition: it reads the
    LlamaModel's uploaded tensors (fused wqkv / w_gate_up where llama.py fused them) and config, and the sequence's
    pages in a CudaPagePool. Both paths compute what LlamaModel.forward_carve computes (embedding row; per layer
    RMSNorm -> QKV -> RoPE -> K/V write -> causal GQA attention -> output projection + residual -> RMSNorm ->
    gate/up -> SwiGLU -> down + residual; final RMSNorm, output projection):

    * decode: matvecs on int8 q8_1 activations (``dp4a``) or f32 ones; RoPE and the K/V write in the QKV matvec's
      epilogue (f16 cache, adjacent RoPE pairs); split-K decode attention (``attn``: "v1" below AUTO_V2_FROM
      positions, the GQA-shared "v2" from there and for a q8_0 cache) that merges its own splits; SwiGLU inside the
      gate/up matvec (``glu``); the RMSNorms handed off by the output / down matvecs (``norm_handoff``: they add into
      the residual stream and write the next norm's quantized input and sums of squares), else computed inside the
      QKV and gate/up matvecs (``fused_norm``), else separate launches with the residual add; the down projection
      one block per row from ``mv_block_from`` sub-blocks. The variant is chosen over the carve's layers; at a
      carve's edges the residual stream is plain f32 in d['x'] in every variant.
    * prefill (``prefill``): cuBLAS GEMMs on f16 operands with f32 accumulation (the residual add done by the GEMM,
      beta = 1), RMSNorm and SwiGLU writing f16 GEMM inputs, RoPE fused with the K/V write, FlashAttention-2.

    ``unsupported(model)`` says why a model cannot use the plan: Q/K/V biases, RoPE frequency factors or linear
    scaling, a head_dim that is not 32/64/128/256, more than 8 query heads per KV head.
    """

    def __init__(self, model, pool, use_graphs: bool | None = None, lo: int = 0, hi: int | None = None):
        super().__init__(model, pool, use_graphs, lo, hi)
        cp, E = self.cp, self.n_embd
        self.neox = int(bool(model.config.rope_neox))
        self._attention_buffers()
        self.d.update({"x2": cp.zeros((1, E), cp.float32),
                       "ss": cp.zeros(max(1, E // 32), cp.float32),     # norm handoff: sums of x^2 per 32 rows
                       "hcnt": cp.zeros(max(1, E // 32), cp.uint32)})   # norm handoff: rows done per group
        self.glu = settings.GLU                   # SwiGLU fused into the gate/up matvec
        self.attn = settings.ATTN                 # "v1" | "v2" | "auto" (decode attention kernel)
        self.fused_norm = True                    # RMSNorms in the QKV and gate/up matvecs where they fit
        self.norm_handoff = True                  # or handed off by the output / down matvecs (preferred)
        self.mv_block_from = settings.MV_BLOCK_FROM
        self.weight_bytes = sum(w.nbytes for L in self.layers() for w in
                                (L.wqkv, L.wq, L.wk, L.wv, L.wo, L.w_gate_up, L.w_gate, L.w_up, L.w_down)
                                if isinstance(w, DeviceWeight)) + \
            (model.output.nbytes if self.last else 0) + \
            (model.tok_embd.nbytes // max(1, self.n_vocab) if self.first else 0)   # one embedding row per token

    @staticmethod
    def unsupported(model, lo: int = 0, hi: int | None = None) -> str | None:
        """Why the plan cannot run the carve [lo, hi) of `model` (hi None: to the last block), or None if it can."""
        if getattr(model, "arch", None) != "llama":
            return f"architecture {getattr(model, 'arch', None)!r} is not 'llama'"
        if getattr(model, "rope_freqs", None) is not None or getattr(model, "freq_scale", 1.0) != 1.0:
            return "RoPE frequency factors / linear scaling"
        hi = model.config.n_layer if hi is None else hi
        if any(L.bq is not None or L.bk is not None or L.bv is not None for L in model.layers[lo:hi]):
            return "Q/K/V biases"
        c = model.config
        if c.head_dim not in settings.ATTN_HEAD_DIMS or model.n_rot > c.head_dim or model.n_rot % 2:
            return f"head_dim {c.head_dim} / n_rot {model.n_rot} (needs 32, 64, 128 or 256)"
        if c.n_head // c.n_head_kv > 8:
            return f"{c.n_head // c.n_head_kv} query heads per KV head (at most 8)"
        # the embeddings only in the first stage, the output head only in the last
        if lo == 0 and not isinstance(model.tok_embd, DeviceWeight) or \
                model.ends_with_head(hi) and not isinstance(model.output, DeviceWeight):
            return "weights are not on the CUDA backend"
        return None

    def prefill_supported(self) -> bool:
        """Whether ``prefill`` can run this carve (fused QKV and gate/up weights, head_dim 64 or 128)."""
        return self.hd in FLASH_HEAD_DIMS and all(L.wqkv is not None and L.w_gate_up is not None
                                                  for L in self.layers())

    def takes_prefill(self, n: int) -> bool:
        return self.prefill_supported()

    # ---- which fused form the decode step takes
    def _qkv_rope(self, L) -> bool:
        """Whether the decode graph fuses RoPE and the K / V write into layer L's QKV matvec."""
        return bool(self.dp4a and not self.neox and L.wqkv is not None
                    and lib().strata_matvec_q8_supported(L.wqkv.ggml_type))

    def _glu_weights(self, L):
        """glu_pointers for this layer's FFN when the plan fuses SwiGLU (glu on, int8 activations), else None."""
        if not (self.glu and self.dp4a):
            return None
        return glu_pointers([L.w_gate_up] if L.w_gate_up is not None else [L.w_gate, L.w_up], self.n_ff, self.n_embd)

    def _gu_groups(self, L) -> list:
        """The gate|up matvecs of layer L as (weight, offset, rows) into d['gu']."""
        F = self.n_ff
        return [(L.w_gate_up, 0, 2 * F)] if L.w_gate_up is not None else [(L.w_gate, 0, F), (L.w_up, F, F)]

    def _fused_glus(self) -> list | None:
        """Every layer's glu_pointers when every layer's QKV matvec takes RoPE and its gate/up matvec SwiGLU (what
        both the fused norms and the norm handoff need), else None."""
        layers = self.layers()
        glus = [self._glu_weights(L) for L in layers]
        return glus if all(self._qkv_rope(L) and g is not None for L, g in zip(layers, glus)) else None

    def fused_norm_rows(self) -> int:
        """QKV rows per warp with which the decode graph fuses the RMSNorms into the matvecs, or 0 when it does not:
        every layer's QKV matvec must take RoPE (f16 cache), its gate/up matvec SwiGLU, and the fused kernels must
        fit the device for the layer's weight types and n_embd (strata_fused_norm_supported: n_embd % 32 == 0, <=
        4096, shared memory), tried with FUSED_NORM_R rows per warp, then fewer. All layers or none: the residual
        stream's buffers alternate only in the fused form."""
        if not (self.fused_norm and self.pool.kv == "f16"):
            return 0
        layers, glus = self.layers(), self._fused_glus()
        if glus is None:
            return 0
        lb, rp = lib(), glu_pairs_per_warp(self.n_ff, self.n_sm)
        for r in dict.fromkeys((FUSED_NORM_R, 2, 1)):
            if all(lb.strata_fused_norm_supported(L.wqkv.ggml_type, g[0], self.n_embd, r, rp)
                   for L, g in zip(layers, glus)):
                return r
        return 0

    def handoff_ok(self) -> bool:
        """Whether the decode graph hands the RMSNorms off: every layer's QKV matvec takes RoPE (f16 cache) and its
        gate/up matvec SwiGLU, the output and down projections have dp4a kernels, n_embd % 32 == 0 and <= 4096. All
        layers or none."""
        if not (self.norm_handoff and self.dp4a and self.pool.kv == "f16" and self.n_embd % 32 == 0
                and self.n_embd <= 4096):
            return False
        lb = lib()
        return self._fused_glus() is not None and all(
            L.wo is not None and lb.strata_matvec_q8_supported(L.wo.ggml_type)
            and lb.strata_matvec_q8_supported(L.w_down.ggml_type) for L in self.layers())

    def decode_attn_v2(self, size_class: int) -> bool:
        """Whether the decode step of this size class uses the GQA-shared kernel (strata_attn_decode_gqa) rather
        than the first split-K kernel: always for a q8_0 cache (the first kernel reads f16 only), else by
        self.attn ("v2", "v1", or "auto": from AUTO_V2_FROM positions up)."""
        if self.pool.kv == "q8_0" or self.attn == "v2":
            return True
        return self.attn == "auto" and size_class >= AUTO_V2_FROM

    def attn_resident(self) -> int:
        """Resident blocks per multiprocessor of this plan's v2 decode attention kernel (gqa_resident)."""
        return gqa_resident(self.hd, self.n_head // max(1, self.n_kv), self.pool.kv == "q8_0")

    def _step_args(self, size_class: int) -> tuple:
        v2 = self.decode_attn_v2(size_class)
        n_split = n_split_class(size_class, self.n_kv, self.n_sm, self.attn_resident()) if v2 else \
            n_split_for(size_class)
        return n_split, v2

    # ---- the decode step
    def _enqueue_step(self, n_split: int, v2: bool, graph: bool = False) -> None:
        """One decode step (DecodePlan._enqueue_step); decode attention by strata_attn_decode_gqa (v2) or the first
        split-K kernel, n_split partitions. In a captured graph only the last launch writes the position and length,
        so the kernels read them and the page table before their PDL wait (not so for eager steps, whose launches
        overlap the previous step's)."""
        lb, d, m, pool = lib(), self.d, self.model, self.pool
        f = ffi()
        s = stream_ptr()
        E, H, KV, hd, F = self.n_embd, self.n_head, self.n_kv, self.hd, self.n_ff
        nq, kvd = H * hd, KV * hd
        tok_p, pos_p, len_p = self._inp()
        NULL = f.NULL
        hq, aq, fq = self._qp("hq"), self._qp("aq"), self._qp("fq")
        ctr = f.cast("unsigned *", d["counters"].data.ptr)
        pt = pool._pt
        self._embed_row(s, tok_p)
        pre = int(graph)                   # position, length and page table read before the PDL waits
        handoff = self.handoff_ok()        # the RMSNorms handed off by the output / down projections
        fused_r = 0 if handoff else self.fused_norm_rows()   # or inside the QKV and gate/up matvecs
        fused = fused_r > 0
        # the residual stream: fused, it alternates between x and x2 (a fused norm's block 0 writes x + delta to the
        # other buffer while every block reads both), delta = the last matvec's output not yet added (None: none);
        # handed off, the matvecs add to x in place
        xa, xb, delta = d["x"], d["x2"], None
        ss, hcnt = fptr(d["ss"]), f.cast("unsigned *", d["hcnt"].data.ptr)
        first_norm = m.layers[self.lo].attn_norm    # the carve's first layer normalizes its input, as layer 0 does
        if handoff:
            check(lb.strata_norm_q8(s, ptr(d["x"]), ptr(first_norm), hq, ss, E), "norm_q8")
        elif not fused:
            self._norm(s, d["x"], first_norm)
        qkv = d["qkv"]
        for li in range(self.lo, self.hi):
            L = m.layers[li]
            end = li + 1 == self.hi        # the carve's last layer
            slot = pool.slot(li)
            kc, vc = pool.k[slot], pool.v[slot]
            ks, vs = pool.scales(slot)
            rope_fused = ks is None and self._qkv_rope(L)
            if rope_fused:   # RoPE and the K / V write in the QKV matvec's epilogue (and the norm in its prologue)
                norm = (ptr(xa), ptr(delta), ptr(L.attn_norm), ptr(xb)) if fused else (NULL, NULL, NULL, NULL)
                check(lb.strata_matvec_q8w_rope(s, L.wqkv.ggml_type, ptr(L.wqkv), hq, fptr(qkv), H, KV, hd, E,
                                                fused_r if fused else HANDOFF_R if handoff else
                                                rows_per_warp(nq + 2 * kvd), pos_p,
                                                ptr(kc), ptr(vc), ptr(pt), self.n_rot, self.theta, pool.page_size,
                                                *norm, self.eps, pre, ss if handoff else NULL), "matvec_rope")
                if fused:
                    xa, xb = xb, xa
            else:
                groups = [(L.wqkv, 0, nq + 2 * kvd)] if L.wqkv is not None else \
                    [(L.wq, 0, nq), (L.wk, nq, kvd), (L.wv, nq + kvd, kvd)]
                self._mv(s, groups, qkv, d["hn"], d["hq"], E)
                if ks is None:
                    check(lb.strata_rope_kv_decode(s, fptr(qkv), pos_p, ptr(kc), ptr(vc), ptr(pt), H, KV, hd,
                                                   self.n_rot, self.theta, self.neox, pool.page_size), "rope_kv")
                else:   # q8_0 cache: RoPE in place, then the K/V rows quantized into the cache
                    check(lb.strata_rope_kv_decode(s, fptr(qkv), pos_p, NULL, NULL, ptr(pt), H, KV, hd, self.n_rot,
                                                   self.theta, self.neox, pool.page_size), "rope")
                    check(lb.strata_kv_write_q8(s, fptr(qkv, nq), nq + 2 * kvd, fptr(qkv, nq + kvd), nq + 2 * kvd,
                                                ptr(kc), ptr(vc), ptr(ks), ptr(vs), ptr(pt), pos_p, 0, 1, KV, hd,
                                                pool.page_size), "kv_write_q8")
            if v2:
                check(lb.strata_attn_decode_gqa(s, fptr(qkv), ptr(kc), ptr(vc), ptr(pt), len_p, 0, ptr(d["partial"]),
                                                ctr, ptr(d["att"]), aq, H, KV, hd, pool.page_size, n_split, self.scale,
                                                ptr(ks), ptr(vs)), "attn")
            else:
                check(lb.strata_attn_decode_ex(s, fptr(qkv), ptr(kc), ptr(vc), ptr(pt), len_p, 0, ptr(d["partial"]),
                                               ptr(d["att"]), aq, ctr, pre, H, KV, hd, pool.page_size, n_split,
                                               self.scale), "attn")
            glu = self._glu_weights(L)
            if handoff:      # x += Wo att, handing off the FFN norm; gate/up scaled by its 1 / rms; x += W_down act
                check(lb.strata_matvec_q8_resid(s, L.wo.ggml_type, ptr(L.wo), aq, E, nq, rows_per_warp(E), 0,
                                                ptr(xa), ptr(L.ffn_norm), hq, ss, hcnt), "matvec_resid")
                check(lb.strata_matvec_q8w_glu_norm(s, glu[0], addr(glu[1]), addr(glu[2]), hq, ptr(d["act"]), fq, F, E,
                                                    glu_pairs_per_warp(F, self.n_sm), NULL, NULL, NULL, NULL,
                                                    self.eps, ss), "matvec_glu_norm")
                block = self._block_rows(F)
                # no handoff past the carve: a middle stage ends with x (in place) and the next stage normalizes it
                check(lb.strata_matvec_q8_resid(s, L.w_down.ggml_type, ptr(L.w_down), fq, E, F,
                                                MV_BLOCK_ROWS if block else rows_per_warp(E), int(block), ptr(xa),
                                                NULL if end else ptr(m.layers[li + 1].attn_norm), hq, ss, hcnt),
                      "matvec_resid")
                if end and self.last:
                    self._norm(s, xa, m.out_norm)
                continue
            self._mv(s, [(L.wo, 0, E)], d["o"], d["att"], d["aq"], nq)
            if fused:        # the norm in the gate/up matvec's prologue: x + o -> the other residual buffer
                check(lb.strata_matvec_q8w_glu_norm(s, glu[0], addr(glu[1]), addr(glu[2]), NULL, ptr(d["act"]), fq, F,
                                                    E, glu_pairs_per_warp(F, self.n_sm), ptr(xa), ptr(d["o"]),
                                                    ptr(L.ffn_norm), ptr(xb), self.eps, NULL), "matvec_glu_norm")
                xa, xb = xb, xa
                self._mv(s, [(L.w_down, 0, E)], d["o"], d["act"], d["fq"], F, long_rows=True)
                delta = d["o"]
                if end:
                    self._layer_end(s, li, L.ffn_norm, x=xa)
                continue
            self._norm(s, d["o"], L.ffn_norm, residual=d["x"])
            self._ffn(s, self._gu_groups(L), L.w_down, glu, long_rows=True)
            self._layer_end(s, li, L.ffn_norm, x=xa)
        self._head(s, tok_p, pos_p)

    # ---- the short read
    def short_form(self) -> str | None:
        """'handoff' when the decode step hands its norms off, 'separate' when it runs them as their own launches
        (both mirrored column by column); None when it fuses them into the matvecs (the short read then steps)."""
        if self.handoff_ok():
            return "handoff"
        return None if self.fused_norm_rows() else "separate"

    @staticmethod
    def _row_v2(args: tuple) -> bool:
        return bool(args[1])

    def _enqueue_short(self, form: str, n: int, rows: tuple, all_logits: bool, graph: bool = False,
                       tables: tuple[int, int] | None = None) -> None:
        """The decode step (_enqueue_step) of `form` over n columns: the matvecs through the column launchers, the
        norms, SwiGLU, attention, the first norm handoff and (separate form) RoPE + K/V write through their rows
        launchers. tables: (device address, stride) of one page table per column, each column a sequence of its own
        (a batched step, strata/backend/cuda/batch.py); None: the columns are one sequence's tokens."""
        lb, c, m, pool = lib(), self.c, self.model, self.pool
        f = ffi()
        s = stream_ptr()
        E, H, KV, hd, F = self.n_embd, self.n_head, self.n_kv, self.hd, self.n_ff
        nq, kvd = H * hd, KV * hd
        NULL = f.NULL
        pos_p = self._rows_inp(0)[1]
        pt = pool._pt
        handoff = form == "handoff"
        ss, hcnt = self._col("ss", 0), f.cast("unsigned *", c["hcnt"].data.ptr)
        self._cols_embed(s, n)
        first_norm = m.layers[self.lo].attn_norm
        if handoff:
            check(lb.strata_mvc_norm_q8(s, self._col("x", 0), ptr(first_norm), self._col("hq", 0), ss, E, n),
                  "mvc_norm_q8")
        else:
            self._cols_norm(s, n, "x", first_norm)
        for li in range(self.lo, self.hi):
            L = m.layers[li]
            end = li + 1 == self.hi
            slot = pool.slot(li)
            kc, vc = pool.k[slot], pool.v[slot]
            ks, vs = pool.scales(slot)
            if ks is None and self._qkv_rope(L):
                tab = (ptr(pt), 0) if tables is None else (addr(tables[0]), tables[1])
                check(lb.strata_mvc_q8w_rope(s, L.wqkv.ggml_type, ptr(L.wqkv), self._col("hq", 0), self._col("qkv", 0),
                                             H, KV, hd, E, n, pos_p, ptr(kc), ptr(vc), *tab, self.n_rot,
                                             self.theta, pool.page_size, self.eps, ss if handoff else NULL),
                      "mvc_rope")
            else:
                groups = [(L.wqkv, 0, nq + 2 * kvd)] if L.wqkv is not None else \
                    [(L.wq, 0, nq), (L.wk, nq, kvd), (L.wv, nq + kvd, kvd)]
                self._cols_mv(s, groups, "qkv", "hn", "hq", E, n)
                self._cols_rope_kv(s, n, "qkv", kc, vc, ks, vs, self.neox, tables)
            self._cols_attn_rows(s, li, rows, "qkv", "att", "aq", tables)
            glu = self._glu_weights(L)
            if handoff:
                check(lb.strata_mvc_q8_resid(s, L.wo.ggml_type, ptr(L.wo), self._col("aq", 0), E, nq, n, 0,
                                             ptr(c["x"]), ptr(L.ffn_norm), self._col("hq", 0), ss, hcnt),
                      "mvc_resid")
                check(lb.strata_mvc_q8w_glu(s, glu[0], addr(glu[1]), addr(glu[2]), self._col("hq", 0),
                                            self._col("act", 0), self._col("fq", 0), F, E, n, self.eps, ss),
                      "mvc_glu")
                check(lb.strata_mvc_q8_resid(s, L.w_down.ggml_type, ptr(L.w_down), self._col("fq", 0), E, F, n,
                                             int(self._block_rows(F)), ptr(c["x"]),
                                             NULL if end else ptr(m.layers[li + 1].attn_norm), self._col("hq", 0), ss,
                                             hcnt), "mvc_resid")
                if end and self.last:
                    self._cols_norm(s, n, "x", m.out_norm)
                continue
            self._cols_mv(s, [(L.wo, 0, E)], "o", "att", "aq", nq, n)
            self._cols_norm(s, n, "o", L.ffn_norm, residual="x")
            self._cols_ffn(s, n, self._gu_groups(L), L.w_down, glu, long_rows=True)
            self._cols_layer_end(s, n, li, L.ffn_norm)
        self._cols_head(s, n, all_logits)

    # ---- prefill
    def prefill(self, tokens, state, all_logits: bool = False, x_in=None):
        """LlamaModel.forward(tokens, state, all_logits) for n >= 1 tokens on the current stream -> host f32 logits
        (n_vocab,) of the last token, or (n, n_vocab) with all_logits. Same errors and bookkeeping. A carve: a stage
        after the first starts from x_in (CuPy f32 (n, n_embd) on the plan's device) instead of the embedding rows
        (the tokens are counted and recorded all the same); a stage before the last returns its hidden states, a
        CuPy f32 (n, n_embd) array of its own (all_logits unused)."""
        cp, lb, m, pool, pf = self.cp, lib(), self.model, self.pool, self.pf
        toks, x = self._prefill_begin(tokens, state, x_in)
        n = int(toks.shape[0])
        s = stream_ptr()
        E, H, KV, hd = self.n_embd, self.n_head, self.n_kv, self.hd
        nq, kvd = H * hd, KV * hd
        W = nq + 2 * kvd
        NULL = ffi().NULL
        pos0 = int(state.pos)
        pt = pool.table(state.kv.pages)
        h16 = pf.buf("h16", (n, max(E, nq)), cp.float16)
        qkv = pf.buf("qkv", (n, W), cp.float32)
        n_split = fa2_splits(n, H, pos0 + n, self.n_sm)
        ws = pf.buf("ws", (n_split * H * n * (hd + 2),), cp.float32) if n_split > 1 else None
        hE = h16[:, :E] if h16.shape[1] == E else pf.buf("hE", (n, E), cp.float16)
        att16 = h16[:, :nq] if h16.shape[1] == nq else pf.buf("att16", (n, nq), cp.float16)
        gu, act16 = self._prefill_ffn_buffers(n)
        for li in range(self.lo, self.hi):
            L = m.layers[li]
            slot = pool.slot(li)
            kc, vc = pool.k[slot], pool.v[slot]
            ks, vs = pool.scales(slot)
            self._prefill_norm(s, x, L.attn_norm, hE)
            pf.gemm(hE, L.wqkv, qkv, False)
            q8 = ks is not None        # q8_0 cache: RoPE in place, then the K/V rows quantized into the cache
            check(lb.strata_rope_kv_prefill(s, ptr(qkv), W, pos0, NULL if q8 else ptr(kc), NULL if q8 else ptr(vc),
                                            ptr(pt), n, H, KV, hd, self.n_rot, self.theta, self.neox, pool.page_size),
                  "rope_kv_prefill")
            if q8:
                check(lb.strata_kv_write_q8(s, fptr(qkv, nq), W, fptr(qkv, nq + kvd), W, ptr(kc), ptr(vc), ptr(ks),
                                            ptr(vs), ptr(pt), NULL, pos0, n, KV, hd, pool.page_size), "kv_write_q8")
            check(lb.strata_fa2_prefill(s, ptr(qkv), W, ptr(kc), ptr(vc), ptr(pt), NULL, ptr(att16), ptr(ws), n, H, KV,
                                        hd, pool.page_size, pos0, n_split, self.scale, ptr(ks), ptr(vs)), "fa2_prefill")
            pf.gemm(att16, L.wo, x, True)
            self._prefill_ffn(s, x, L.ffn_norm, [(L.w_gate_up, 0, 2 * self.n_ff)], L.w_down, hE, gu, act16)
        return self._prefill_end(x, toks, state, all_logits)


class LlamaPlanModel(PlanModel):
    """The llama family's PlanModel (runner.PlanModel with LlamaCuda plans)."""

    plan_class = LlamaCuda
    keeps_states = True     # a verify (short read) keeps nothing but K/V rows: a Commit cuts the pages back
