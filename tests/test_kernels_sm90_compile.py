"""Compile the Triton kernels for Hopper (sm_90) on a machine without a GPU.

The interpreter tests check what the kernels compute; they cannot see whether a
kernel compiles for the GPU, spills registers, fits in shared memory, or uses
Hopper's wgmma tensor-core path with pipelined (cp.async) loads. Triton can
compile ahead of time for a named target, so this test does, at the tile sizes
the CUDA paths use. It runs in a subprocess because other kernel tests put
Triton into interpreter mode for this process.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tests.sm90_compile import compile_in_child

SMEM_LIMIT = 227 * 1024  # H100/H200 max dynamic shared memory per block


def _compile_all() -> dict[str, dict[str, Any]]:
    import triton.language as tl

    from ftserve_kernels import attention_extend_triton as ate
    from ftserve_kernels import attention_triton as at
    from ftserve_kernels import bookkeeping as bk
    from ftserve_kernels import moe_align_triton as ma
    from ftserve_kernels import moe_down_gemv_triton as md
    from ftserve_kernels import moe_gemv_triton as mg
    from ftserve_kernels import moe_triton as mt
    from ftserve_kernels import norm_triton as nt
    from ftserve_kernels import rope_triton as rt
    from tests.sm90_compile import build_sm90, constexpr_defaults, resources

    results: dict[str, dict[str, Any]] = {}

    def comp(name: str, fn: Any, types: dict[str, str], consts: dict[str, Any],
             warps: int = 4, stages: int = 3) -> None:
        # Optional features off unless the kernel defaults them; a name it lacks is dropped.
        consts = {"HAS_MAP": False, "FP8": False, "PDL": False, "READ_THROUGH": False, "BLOCK_M": 1,
                  "QK": False} | constexpr_defaults(fn) | consts
        types = {"map_ptr": "*i32", "ks_ptr": "*fp32", "vs_ptr": "*fp32", "bank": "i64",
                 "miss_slot_ptr": "*i32", "miss_id_ptr": "*i32"} | types
        k = build_sm90(fn, types, consts, warps, stages)  # pointers and strides divisible by 16
        if isinstance(k, dict):  # reported, asserted on by the test
            results[name] = k
            return
        ptx = k.asm["ptx"]
        body = ptx[ptx.index(".entry"):]
        wait = body.find("griddepcontrol.wait")
        results[name] = resources(k)[0] | {
            "wgmma": "wgmma" in ptx, "cp_async": "cp.async" in ptx,
            "pdl_wait": wait >= 0, "pdl_release": "griddepcontrol.launch_dependents" in body,
            "loads_before_wait": body[:wait].count("ld.global") if wait >= 0 else -1}

    bf, i32 = "*bf16", "*i32"
    comp("store_kv", at._store_kv_kernel,
         {"k_ptr": bf, "v_ptr": bf, "kc_ptr": bf, "vc_ptr": bf, "loc_ptr": "*i64"},
         dict(HKV=4, D=128, BLOCK_H=4, BLOCK_D=128))
    attn = {"q_ptr": bf, "o_ptr": bf, "kc_ptr": bf, "vc_ptr": bf, "pt_ptr": i32,
            "qo_indptr_ptr": i32, "prefix_ptr": i32, "seq_lens_ptr": i32,
            "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "scale_log2": "fp32"}
    cfg = at.AttnKernelConfig.for_device(__import__("torch").device("cuda"), 128)
    comp("decode_split", at._decode_split_kernel, attn,
         dict(PAGE_SIZE=16, GROUP=8, D=128, BLOCK_D=128, BLOCK_G=16,
              BLOCK_N=cfg.decode_block_n, NUM_SPLITS=64, UPCAST=False), cfg.decode_warps, cfg.decode_stages)
    # Raw q/k in, the q/k norms, the rotary and the KV store inside (DecodeQK).
    comp("decode_split_qk", at._decode_split_kernel,
         attn | {"k_ptr": bf, "v_ptr": bf, "qw_ptr": bf, "kw_ptr": bf, "pos_ptr": "*i64",
                 "cs_ptr": "*fp32", "loc_ptr": "*i64", "eps": "fp32"},
         dict(PAGE_SIZE=16, GROUP=8, D=128, BLOCK_D=128, BLOCK_G=16,
              BLOCK_N=cfg.decode_block_n, NUM_SPLITS=64, UPCAST=False, QK=True), cfg.decode_warps, cfg.decode_stages)
    # A model without q/k norms (Llama, SmolLM2's heads: 9 q / 3 kv of 64): the rotary
    # and the KV store alone inside the split kernel.
    cfg64 = at.AttnKernelConfig.for_device(__import__("torch").device("cuda"), 64)
    comp("decode_split_qk_nonorm", at._decode_split_kernel,
         attn | {"k_ptr": bf, "v_ptr": bf, "qw_ptr": bf, "kw_ptr": bf, "pos_ptr": "*i64",
                 "cs_ptr": "*fp32", "loc_ptr": "*i64", "eps": "fp32"},
         dict(PAGE_SIZE=16, GROUP=3, D=64, BLOCK_D=64, BLOCK_G=16,
              BLOCK_N=cfg64.decode_block_n, NUM_SPLITS=64, UPCAST=False, QK=True, NORM=False),
         cfg64.decode_warps, cfg64.decode_stages)
    # A verify step's queries (DecodeQK.first_rows): each adds its sequence's new keys
    # (up to MAX_VERIFY_ROWS) from registers; SmolLM2's heads at 4 rows, qwen3's at 8.
    qk_types = attn | {"k_ptr": bf, "v_ptr": bf, "qw_ptr": bf, "kw_ptr": bf, "pos_ptr": "*i64",
                       "cs_ptr": "*fp32", "loc_ptr": "*i64", "eps": "fp32", "first_ptr": "*i64"}
    comp("decode_split_qk_verify4_nonorm", at._decode_split_kernel, qk_types,
         dict(PAGE_SIZE=16, GROUP=3, D=64, BLOCK_D=64, BLOCK_G=16, BLOCK_N=cfg64.decode_block_n,
              NUM_SPLITS=64, UPCAST=False, QK=True, NORM=False, BLOCK_J=4),
         cfg64.decode_warps, cfg64.decode_stages)
    comp("decode_split_qk_verify8", at._decode_split_kernel, qk_types,
         dict(PAGE_SIZE=16, GROUP=8, D=128, BLOCK_D=128, BLOCK_G=16, BLOCK_N=cfg.decode_block_n,
              NUM_SPLITS=64, UPCAST=False, QK=True, BLOCK_J=8), cfg.decode_warps, cfg.decode_stages)
    # fp8 e4m3 KV pages (codes + per-token scales): store, decode and extend.
    fp8 = "*fp8e4nv"
    comp("store_kv_fp8", at._store_kv_kernel,
         {"k_ptr": bf, "v_ptr": bf, "kc_ptr": fp8, "vc_ptr": fp8, "loc_ptr": "*i64"},
         dict(HKV=4, D=128, BLOCK_H=4, BLOCK_D=128, FP8=True))
    attn8 = attn | {"kc_ptr": fp8, "vc_ptr": fp8}
    comp("decode_split_fp8", at._decode_split_kernel, attn8,
         dict(PAGE_SIZE=16, GROUP=8, D=128, BLOCK_D=128, BLOCK_G=16, BLOCK_N=cfg.decode_block_n,
              NUM_SPLITS=64, UPCAST=False, FP8=True),
         cfg.decode_warps, cfg.decode_stages)
    comp("extend_fp8", ate._extend_kernel, attn8,
         dict(PAGE_SIZE=16, GROUP=8, D=128, BLOCK_M=cfg.extend_block_m, BLOCK_N=cfg.extend_block_n,
              UPCAST=False, FP8=True),
         cfg.extend_warps, cfg.extend_stages)
    comp("decode_reduce", at._decode_reduce_kernel, attn,
         dict(NUM_SPLITS=64, BLOCK_S=64, D=128, BLOCK_D=128), 4, 1)
    comp("extend", ate._extend_kernel, attn,
         dict(PAGE_SIZE=16, GROUP=8, D=128, BLOCK_M=cfg.extend_block_m,
              BLOCK_N=cfg.extend_block_n, UPCAST=False),
         cfg.extend_warps, cfg.extend_stages)
    # Split-K extend (few new tokens over a long prefix): 64-row blocks at d 128, 16-row
    # blocks at Qwen3-Next's d 256 (its config: 32-key tiles, 2 stages), fp8 pages; the reduce.
    comp("extend_split", ate._extend_split_kernel, attn,
         dict(PAGE_SIZE=16, GROUP=8, D=128, BLOCK_M=cfg.extend_block_m, BLOCK_N=cfg.extend_block_n,
              NUM_SPLITS=8, UPCAST=False),
         cfg.extend_warps, cfg.extend_stages)
    cfg256 = at.AttnKernelConfig.for_device(__import__("torch").device("cuda"), 256)
    comp("extend_split_bm16_d256", ate._extend_split_kernel, attn,
         dict(PAGE_SIZE=16, GROUP=8, D=256, BLOCK_M=16, BLOCK_N=cfg256.extend_block_n, NUM_SPLITS=32,
              UPCAST=False),
         cfg256.extend_warps, cfg256.extend_stages)
    comp("extend_split_fp8", ate._extend_split_kernel, attn8,
         dict(PAGE_SIZE=16, GROUP=8, D=128, BLOCK_M=cfg.extend_block_m, BLOCK_N=cfg.extend_block_n,
              NUM_SPLITS=8, UPCAST=False, FP8=True),
         cfg.extend_warps, cfg.extend_stages)
    comp("extend_split_grouped_d256", ate._extend_split_kernel, attn,  # group_heads: 8 tokens x 8 heads
         dict(PAGE_SIZE=16, GROUP=8, D=256, BLOCK_M=64, BLOCK_N=cfg256.extend_block_n, NUM_SPLITS=32,
              UPCAST=False, BLOCK_G=8),
         cfg256.extend_warps, cfg256.extend_stages)
    comp("extend_reduce", ate._extend_reduce_kernel, attn, dict(NUM_SPLITS=32, BLOCK_S=32, D=256), 4, 1)
    comp("route", mt._route_kernel, {"logits_ptr": "*fp32", "w_ptr": "*fp32", "ids_ptr": i32},
         dict(TOP_K=8, BLOCK_T=16, BLOCK_E=128, BLOCK_K=8, RENORM=True))
    align = {"ids_ptr": i32, "hist_ptr": i32, "sorted_ptr": i32, "block_expert_ptr": i32,
             "total_ptr": i32, "valid_ptr": i32}
    for pre in (False, True):  # valid_ptr: as captured prefill graphs launch them
        comp(f"align_place_{pre}", ma._align_place_kernel, align,
             dict(BLOCK_M=64, BLOCK_E=128, CHUNK=128, HIST_ROWS=32, FILL=64, PRECOUNTED=pre, HAS_VALID=True), 8)
    comp("align_hist", ma._align_hist_kernel, align, dict(BLOCK_E=128, CHUNK=128, HAS_VALID=True))
    # qwen3-next's 512 experts at the tuned 512-pair chunks (four 128-pair sub-chunks)
    comp("align_place_e512", ma._align_place_kernel, align,
         dict(BLOCK_M=128, BLOCK_E=512, CHUNK=512, HIST_ROWS=8, FILL=16, PRECOUNTED=True, HAS_VALID=True), 8)
    comp("align_hist_e512", ma._align_hist_kernel, align, dict(BLOCK_E=512, CHUNK=512, HAS_VALID=True))
    moe = {"x_ptr": bf, "a_ptr": bf, "w_ptr": bf, "out_ptr": bf, "weights_ptr": "*fp32",
           "sorted_ptr": i32, "block_expert_ptr": i32, "total_ptr": i32}
    for t in (1, 8192):
        c = mt.MoeConfig.pick(t * 8, 128, __import__("torch").device("cuda"))
        common = dict(BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                      GROUP_M=c.group_m, EVEN_K=True, UPCAST=False)
        comp(f"moe_gate_up_T{t}", mt._moe_gate_up_kernel, moe, dict(TOP_K=8, **common),
             c.num_warps, c.num_stages)
        comp(f"moe_down_T{t}", mt._moe_down_kernel, moe, common, c.num_warps, c.num_stages)
    comp("moe_down_n128", mt._moe_down_kernel, moe, common | dict(BLOCK_N=128), 8, 3)
    gemv = {"x_ptr": bf, "a_ptr": bf, "w_ptr": bf, "out_ptr": bf, "weights_ptr": "*fp32",
            "ids_ptr": i32}
    comp("moe_gemv_gate_up", mg._gemv_gate_up_kernel, gemv,
         dict(TOP_K=8, BLOCK_N=16, BLOCK_K=512, EVEN_K=True), 8, 2)
    comp("moe_gemv_down", md._gemv_down_combine3d_kernel, gemv | {"eps": "fp32"},
         dict(TOP_K=8, BLOCK_KP=8, BLOCK_N=8, BLOCK_K=256, EVEN_K=True, K_STEPS=3), 8, 2)
    # One decode row routed in o_proj: gate/up over the pending norm, at the table's launch;
    # o_proj + router (oproj_route_triton) at o_proj's.
    comp("moe_gemv_gate_up_parts", mg._gemv_gate_up_kernel,
         gemv | {"parts_ptr": "*fp32", "sel_ptr": "*fp32", "wout_ptr": "*fp32", "eps": "fp32"},
         dict(TOP_K=8, BLOCK_N=16, BLOCK_K=256, EVEN_K=True, HAS_PARTS=True, BLOCK_P=256,
              BLOCK_TK=8), 16, 3)
    from ftserve_kernels import oproj_route_triton as orr

    for bias in (False, True):
        comp("oproj_route" + ("_bias" if bias else ""), orr._oproj_route_kernel,
             {n: bf for n in ("a_ptr", "wo_ptr", "bo_ptr", "r_ptr", "nw_ptr", "ro_ptr", "rr_ptr",
                              "z_ptr", "scaled_ptr")}
             | {n: "*fp32" for n in ("rb_ptr", "parts_ptr", "pre_ptr", "sel_ptr")}
             | {"ids_ptr": i32, "cnt_ptr": i32},
             dict(HAS_BIAS=bias, TOP_K=8, BLOCK_N=8, BLOCK_K=512, K_STEPS=8, N_STEPS=4, BLOCK_E=2,
                  BLOCK_EALL=128, BLOCK_TK=8), 8, 3)
    comp("oproj_route_pdl", orr._oproj_route_kernel,
         {n: bf for n in ("a_ptr", "wo_ptr", "bo_ptr", "r_ptr", "nw_ptr", "ro_ptr", "rr_ptr", "z_ptr", "scaled_ptr")}
         | {n: "*fp32" for n in ("rb_ptr", "parts_ptr", "pre_ptr", "sel_ptr")} | {"ids_ptr": i32, "cnt_ptr": i32},
         dict(HAS_BIAS=False, TOP_K=8, BLOCK_N=8, BLOCK_K=512, K_STEPS=8, N_STEPS=4, BLOCK_E=2,
              BLOCK_EALL=128, BLOCK_TK=8, PDL=True), 8, 3)
    if "HAS_MAP" in mt._moe_gate_up_kernel.arg_names:  # expert -> slot indirection
        comp("moe_gate_up_mapped", mt._moe_gate_up_kernel, moe,
             dict(TOP_K=8, HAS_MAP=True, **common), c.num_warps, c.num_stages)
    comp("rms_norm", nt._rms_norm_kernel,
         {"x_ptr": bf, "r_ptr": bf, "w_ptr": bf, "out_ptr": bf, "sum_ptr": bf, "eps": "fp32"},
         dict(HAS_RESIDUAL=True, BLOCK_R=4, BLOCK_H=2048), 8)
    comp("rms_norm_heads", nt._rms_norm_kernel,
         {"x_ptr": bf, "r_ptr": bf, "w_ptr": bf, "out_ptr": bf, "sum_ptr": bf, "eps": "fp32"},
         dict(HAS_RESIDUAL=False, BLOCK_R=64, BLOCK_H=128), 8)
    # Qwen3-Next's: zero-centered, after the shared expert's gated sum and the residual add
    comp("rms_norm_zero_centered_shared", nt._rms_norm_kernel,
         {"x_ptr": bf, "r_ptr": bf, "w_ptr": bf, "out_ptr": bf, "sum_ptr": bf, "y_ptr": bf, "lg_ptr": bf,
          "eps": "fp32"},
         dict(HAS_RESIDUAL=True, BLOCK_R=4, BLOCK_H=2048, ZERO_CENTERED=True, SHARED=True), 8)
    from ftserve_kernels import glu_triton as gl

    comp("silu_mul_pdl", gl._silu_mul_kernel, {"gu_ptr": bf}, dict(BLOCK=gl._BLOCK, PDL=True), 4)
    comp("gated_rms_norm", nt._gated_rms_norm_kernel,
         {"x_ptr": bf, "g_ptr": bf, "w_ptr": bf, "out_ptr": bf, "eps": "fp32"},
         dict(NH=32, RATIO=2, D=128, BLOCK_R=16, BLOCK_D=128), 4)
    for store in (False, True):  # True: the launch that also stores K/V
        comp("qk_norm_rotary" + ("_store" if store else ""), rt._qk_norm_rotary_kernel,
             {"q_ptr": bf, "k_ptr": bf, "qo_ptr": bf, "ko_ptr": bf, "qw_ptr": bf, "kw_ptr": bf,
              "pos_ptr": "*i64", "cs_ptr": "*fp32", "eps": "fp32", "kc_ptr": bf, "vc_ptr": bf,
              "v_ptr": bf, "loc_ptr": "*i64"},
             dict(HQ=32, HK=4, D=128, HALF=64, BLOCK_R=64, BLOCK_HALF=64, BLOCK_TAIL=1,
                  BLOCK_D=128, STORE=store, PDL=store), 8)  # the store variant with PDL
    # No q/k norms: the same launch is the rotary + KV store (ops.rotary with kv_store).
    comp("rotary_store_pdl", rt._qk_norm_rotary_kernel,
         {"q_ptr": bf, "k_ptr": bf, "qo_ptr": bf, "ko_ptr": bf, "qw_ptr": bf, "kw_ptr": bf,
          "pos_ptr": "*i64", "cs_ptr": "*fp32", "eps": "fp32", "kc_ptr": bf, "vc_ptr": bf,
          "v_ptr": bf, "loc_ptr": "*i64"},
         dict(HQ=9, HK=3, D=64, HALF=32, BLOCK_R=128, BLOCK_HALF=32, BLOCK_TAIL=1,
              BLOCK_D=64, STORE=True, PDL=True, NORM=False), 8)
    comp("qk_norm_rotary_zero_centered_partial", rt._qk_norm_rotary_kernel,  # Qwen3-Next's gated attention
         {"q_ptr": bf, "k_ptr": bf, "qo_ptr": bf, "ko_ptr": bf, "qw_ptr": bf, "kw_ptr": bf,
          "pos_ptr": "*i64", "cs_ptr": "*fp32", "eps": "fp32", "kc_ptr": bf, "vc_ptr": bf,
          "v_ptr": bf, "loc_ptr": "*i64"},
         dict(HQ=16, HK=2, D=256, HALF=32, BLOCK_R=16, BLOCK_HALF=32, BLOCK_TAIL=256,
              BLOCK_D=256, STORE=True, ZERO_CENTERED=True), 8)
    # PDL (ftserve_kernels/pdl.py): the decode kernels' grid-dependency wait.
    comp("decode_split_pdl", at._decode_split_kernel, attn,
         dict(PAGE_SIZE=16, GROUP=8, D=128, BLOCK_D=128, BLOCK_G=16, BLOCK_N=cfg.decode_block_n,
              NUM_SPLITS=64, UPCAST=False, PDL=True),
         cfg.decode_warps, cfg.decode_stages)
    comp("decode_reduce_pdl", at._decode_reduce_kernel, attn,
         dict(NUM_SPLITS=64, BLOCK_S=64, D=128, BLOCK_D=128, PDL=True), 4, 1)
    comp("rms_norm_pdl", nt._rms_norm_kernel,
         {"x_ptr": bf, "r_ptr": bf, "w_ptr": bf, "out_ptr": bf, "sum_ptr": bf, "eps": "fp32"},
         dict(HAS_RESIDUAL=True, BLOCK_R=4, BLOCK_H=2048, PDL=True), 8)
    from ftserve_kernels import filter_triton as ft
    from ftserve_kernels import greedy_triton as gt

    comp("filter_cuts", ft._cuts_kernel,
         {"logits_ptr": "*fp32", "cand_ptr": "*i64", "slots_ptr": "*i64", "min_ptr": "*i1",
          "itab_ptr": "*i64", "ftab_ptr": "*fp32", "cut_key_ptr": "*i32", "cut_id_ptr": "*i32",
          "floor_ptr": "*fp32", "min_temperature": "fp32"},
         dict(NI=5, C=512, BLOCK=1024))
    for cut in (False, True):
        comp("greedy_sample" + ("_cut" if cut else ""), gt._greedy_kernel,
             {"logits_ptr": "*fp32", "slots_ptr": "*i64", "min_ptr": "*i1", "itab_ptr": "*i64",
              "part_v_ptr": "*fp32", "part_i_ptr": "*i32", "count_ptr": "*i32", "out_ptr": "*i64",
              "last_ptr": "*i64", "ftab_ptr": "*fp32", "steps_ptr": "*i64", "min_temperature": "fp32",
              "cut_key_ptr": "*i32", "cut_id_ptr": "*i32", "floor_ptr": "*fp32"},
             dict(NI=5, NUM_CHUNKS=148, BLOCK=1024, BLOCK_C=256, HAS_LAST=True, SAMPLING=True,
                  HAS_CUT=cut))
    comp("greedy_sample_pdl", gt._greedy_kernel,
         {"logits_ptr": "*bf16", "slots_ptr": "*i64", "min_ptr": "*i1", "itab_ptr": "*i64",
          "part_v_ptr": "*fp32", "part_i_ptr": "*i32", "count_ptr": "*i32", "out_ptr": "*i64",
          "last_ptr": "*i64", "ftab_ptr": "*fp32", "steps_ptr": "*i64", "min_temperature": "fp32",
          "cut_key_ptr": "*i32", "cut_id_ptr": "*i32", "floor_ptr": "*fp32"},
         dict(NI=5, NUM_CHUNKS=148, BLOCK=1024, BLOCK_C=256, HAS_LAST=True, SAMPLING=False,
              HAS_CUT=False, PDL=True))
    from ftserve_kernels import decode_inputs as di

    i64 = "*i64"
    comp("decode_inputs_release", di._decode_inputs_kernel,  # a step's first kernel with PDL
         {"packed_ptr": i64, "last_ptr": i64, "pt_ptr": i32, "emb_ptr": bf, "nw_ptr": bf, "normed_ptr": bf,
          "ids_ptr": i64, "pos_ptr": i64, "loc_ptr": i64, "seq_ptr": i32, "pre_ptr": i32, "slot_ptr": i64,
          "step_ptr": i64, "min_ptr": "*i8", "sslot_ptr": i64, "rows_ptr": i32, "out_emb_ptr": bf, "eps": "fp32",
          "parity_ptr": i64},
         dict(FLAG=1 << 62, HAS_EMB=True, HAS_NORM=True, BLOCK_P=1024, BLOCK_H=2048, STAGED=True,
              RELEASE=True))
    comp("rotary", rt._rotary_kernel,
         {"q_ptr": bf, "k_ptr": bf, "qo_ptr": bf, "ko_ptr": bf, "pos_ptr": "*i64", "cs_ptr": "*fp32"},
         dict(HQ=32, HK=4, D=128, HALF=64, BLOCK_HQ=32, BLOCK_HK=4, BLOCK_HALF=64, BLOCK_D=1))
    maps = {n: i32 for n in ("needed_ptr", "slot_of_id_ptr", "id_of_slot_ptr", "out_slot_ptr",
                             "miss_slot_ptr", "miss_id_ptr", "prot_ptr", "victim_ptr")}
    maps |= {"last_used_ptr": "*i64", "step_ptr": "*i64"}
    comp("admit", bk._admit_kernel, maps, dict(BLOCK_M=512, BLOCK_S=2048, CHUNK_J=32), 8)
    comp("invalidate", bk._invalidate_kernel, maps, dict(BLOCK=1024))
    blocks = {"src_idx_ptr": i32, "dst_idx_ptr": i32, "group_stride_src": "i64",
              "group_stride_dst": "i64"}
    host = {"src_a": "i64", "src_b": "i64", "dst_a": "*i16", "dst_b": "*i16"}
    comp("copy_blocks_from_host", bk._copy_blocks_kernel, blocks | host,
         dict(HOST_SRC=True, HOST_DST=False, ELEM=tl.int16, BLOCK=4096))
    to_host = {"src_a": "*i16", "src_b": "*i16", "dst_a": "i64", "dst_b": "i64"}
    comp("copy_blocks_to_host", bk._copy_blocks_kernel, blocks | to_host,
         dict(HOST_SRC=False, HOST_DST=True, ELEM=tl.int16, BLOCK=4096))
    # Gated DeltaNet at Qwen3-Next-80B's shapes: 16 key / 32 value heads of 128, a
    # bf16 model with an fp32 state pool, the conv over 8192 channels of window 3.
    from ftserve_kernels import gated_delta_triton as gdt
    from ftserve_kernels import short_conv_triton as sct

    rule = {"q_ptr": bf, "k_ptr": bf, "v_ptr": bf, "g_ptr": "*fp32", "beta_ptr": bf, "o_ptr": bf,
            "s_ptr": "*fp32", "slot_ptr": "*i64", "has_ptr": "*i1", "cu_ptr": i32, "tinv_ptr": "*fp32",
            "aqk_ptr": bf, "save_ptr": "*i64", "scale": "fp32", "eps": "fp32"}
    heads = dict(HK=16, HV=32, DK=128, BLOCK_K=128)
    for bv in (16, 32, 64):  # decode_block_v's choices
        comp(f"gdn_decode_bv{bv}", gdt._gdn_decode_kernel, rule, heads | dict(DV=128, BLOCK_V=bv, GR=1),
             gdt.decode_warps(128, bv), 1)
        # the model's: g and beta from the projection's a and b ([B, Hk, 2] views), has_state
        # the prefix lengths
        comp(f"gdn_decode_fused_bv{bv}", gdt._gdn_decode_kernel,
             rule | {"g_ptr": bf, "alog_ptr": bf, "dtb_ptr": bf, "has_ptr": i32},
             heads | dict(DV=128, BLOCK_V=bv, GR=2, GATES=True), gdt.decode_warps(128, bv), 1)
    comp("gdn_chunk_local", gdt._chunk_local_kernel, rule, heads | dict(C=64, SB=16),
         gdt.LOCAL_WARPS, 1)
    comp("gdn_chunk_scan", gdt._chunk_scan_kernel, rule,
         heads | dict(DV=128, BLOCK_V=gdt.SCAN_BLOCK_V, C=64, UPCAST=False), gdt.SCAN_WARPS, gdt.scan_stages(2))
    conv = {"x_ptr": bf, "w_ptr": bf, "cs_ptr": bf, "slot_ptr": "*i64", "has_ptr": "*i1", "cu_ptr": i32,
            "out_ptr": bf}
    # An fp32 model: its dots multiply in fp32 (attention_common.mma, gated_delta_triton's
    # EXACT), on the FMA units, at the tile sizes the bf16 launches use.
    f32 = "*fp32"
    comp("fp32_extend", ate._extend_kernel, attn | {"q_ptr": f32, "o_ptr": f32, "kc_ptr": f32, "vc_ptr": f32},
         dict(PAGE_SIZE=16, GROUP=8, D=128, BLOCK_M=cfg.extend_block_m,
              BLOCK_N=cfg.extend_block_n, UPCAST=False),
         cfg.extend_warps, cfg.extend_stages)
    comp("fp32_decode_split", at._decode_split_kernel,
         attn | {"q_ptr": f32, "o_ptr": f32, "kc_ptr": f32, "vc_ptr": f32},
         dict(PAGE_SIZE=16, GROUP=8, D=128, BLOCK_D=128, BLOCK_G=16,
              BLOCK_N=cfg.decode_block_n, NUM_SPLITS=64, UPCAST=False), cfg.decode_warps, cfg.decode_stages)
    moe32 = {n: (f32 if t == bf else t) for n, t in moe.items()}
    comp("fp32_moe_gate_up_T8192", mt._moe_gate_up_kernel, moe32, dict(TOP_K=8, **common),
         c.num_warps, c.num_stages)
    comp("fp32_moe_down_T8192", mt._moe_down_kernel, moe32, common, c.num_warps, c.num_stages)
    rule32 = {n: (f32 if t == bf else t) for n, t in rule.items()}
    comp("fp32_gdn_chunk_local", gdt._chunk_local_kernel, rule32, heads | dict(C=64, SB=16, EXACT=True),
         gdt.LOCAL_WARPS, 1)
    comp("fp32_gdn_chunk_scan", gdt._chunk_scan_kernel, rule32,
         heads | dict(DV=128, BLOCK_V=gdt.SCAN_BLOCK_V, C=64, UPCAST=False), gdt.SCAN_WARPS, gdt.scan_stages(4))
    comp("gdn_conv_decode", sct._conv_decode_kernel, conv | {"x1_ptr": bf, "x2_ptr": bf},
         dict(W=3, BLOCK_E=4, BLOCK_C=sct.CONV_DECODE_BLOCK_C, D0=8192, N0=1, D1=1, N1=0, D2=1, N2=0))
    # the model's: q, k, v read in place from the projection (16 key-head groups), has_state
    # the prefix lengths
    comp("gdn_conv_decode_parts", sct._conv_decode_kernel, conv | {"x1_ptr": bf, "x2_ptr": bf, "has_ptr": i32},
         dict(W=3, BLOCK_E=4, BLOCK_C=sct.CONV_DECODE_BLOCK_C, D0=128, N0=16, D1=128, N1=16, D2=256, N2=16))
    comp("gdn_conv_prefill", sct._conv_prefill_kernel, conv,
         dict(W=3, BLOCK_T=sct.CONV_BLOCK_T, BLOCK_C=sct.CONV_BLOCK_C), sct.CONV_WARPS)
    comp("gdn_conv_state", sct._conv_state_kernel, conv, dict(W=3, BLOCK_W=4, BLOCK_C=sct.CONV_BLOCK_C))
    # A speculative verify step's: the rule token by token (outputs only), and the
    # commit over every layer (state only), the conv windows' commit.
    from ftserve_kernels import gated_delta_verify_triton as gvt

    tokens = rule | {"lo_ptr": i32, "kept_ptr": "*i64"}
    for name, verify in (("gdn_verify", True), ("gdn_commit", False)):
        comp(name, gvt._gdn_tokens_kernel, tokens,
             heads | dict(DV=128, BLOCK_V=gvt.VERIFY_BLOCK_V, VERIFY=verify), gvt.decode_warps(128, gvt.VERIFY_BLOCK_V), 1)
    comp("gdn_conv_commit", gvt._conv_commit_kernel, conv | {"lo_ptr": i32, "kept_ptr": "*i64"},
         dict(W=3, BLOCK_W=4, BLOCK_C=sct.CONV_BLOCK_C))
    return results


def test_kernels_compile_for_sm90() -> None:
    results = compile_in_child([os.path.abspath(__file__)], timeout=600)
    errors = {k: v["error"] for k, v in results.items() if "error" in v}
    assert not errors, errors
    for name, r in results.items():
        assert r["shared"] <= SMEM_LIMIT, (name, r)
        assert r["local"] in (0, -1), f"{name} uses local memory: {r}"
        # An fp32 model's exact (ieee) dots are a parity path, not a serving one: they
        # spill (2026-12-05: fp32_extend 8,360 stack bytes), the serving kernels may not in a loop.
        assert name.startswith("fp32_") or r["loop_spills"] in (0, -1), f"{name} spills registers in a loop: {r}"
    for name in ("extend", "moe_gate_up_T8192", "moe_down_T8192", "gdn_chunk_local", "gdn_chunk_scan"):
        assert results[name]["wgmma"], f"{name} does not use Hopper wgmma: {results[name]}"
        # fp32 operands multiply in fp32: no tensor-core (TF32) instruction
        assert not results["fp32_" + name]["wgmma"], f"fp32_{name} multiplies in TF32: {results['fp32_' + name]}"
    for name, r in results.items():  # the wait and release exactly where PDL is compiled in
        if name.endswith("_release"):  # released at its start, launched without the attribute
            assert r["pdl_release"] and not r["pdl_wait"], (name, r)
        else:  # a dependant waits and never releases the next one early
            pdl = name.endswith("_pdl") or name == "qk_norm_rotary_store"
            assert r["pdl_wait"] == pdl and not r["pdl_release"], (name, r)
    for name in ("decode_split_pdl", "decode_reduce_pdl", "rms_norm_pdl", "qk_norm_rotary_store", "oproj_route_pdl",
                 "greedy_sample_pdl", "rotary_store_pdl", "silu_mul_pdl"):
        # Their every load reads an earlier kernel's output: none may move above the wait.
        assert results[name]["loads_before_wait"] == 0, (name, results[name])
    for name in ("extend", "extend_split", "decode_split", "decode_split_qk", "decode_split_qk_nonorm",
                 "decode_split_qk_verify4_nonorm", "decode_split_qk_verify8", "moe_gate_up_T1",
                 "moe_gate_up_T8192"):
        assert results[name]["cp_async"], f"{name} loads are not pipelined: {results[name]}"


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
