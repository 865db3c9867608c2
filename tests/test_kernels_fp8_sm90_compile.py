"""Compile the fp8 Triton kernels for Hopper (sm_90) on a machine without a GPU,
as test_kernels_sm90_compile.py does for the others, at the launch parameters
the CUDA paths use and qwen3-30b-a3b's shapes (among them the decode GEMVs, the
fused o_proj + router over an fp8 o_proj, and the expert gate/up taking its
route parts): each compiles, fits in shared memory and spills no registers
inside a loop; the prefill kernels spill at most a few words saved once per
program (``stack``, the frame ptxas spills to, at most 16 bytes; cuobjdump's
LOCAL counts local arrays, not spills). The prefill GEMMs multiply e4m3 on the
fp8 wgmma with pipelined (cp.async) loads, at the tile configurations and scale
modes their launchers pick; where PDL is compiled in, the expert GEMVs and the
o_proj + router wait for the kernel before them before any load, and the dense
GEMV loads only its first weight tile ahead of the wait; the dense GEMV (the
bf16 kernel with FP8) and the expert gate/up issue several weight loads before
their first FMA. And every quantizer and decode-kernel launch that
test_kernels_fp8.py makes on the GPU (tests/fp8_cases.py) compiles: the
interpreter cannot reject a constexpr branch the compiler builds. Runs in a
subprocess: other kernel tests put Triton into interpreter mode.
"""

from __future__ import annotations

import json
import os
from typing import Any

from tests.sm90_compile import compile_in_child
from tests.test_kernels_sm90_compile import SMEM_LIMIT

H, INTER, E, K, Q = 2048, 768, 128, 8, 4096  # qwen3-30b-a3b: hidden, expert width, experts, top-k, q rows
MAX_STACK = 16  # bytes: a few values saved before a loop and read back after it


def _compile_all() -> dict[str, dict[str, Any]]:
    import torch
    import triton
    import triton.language as tl

    from ftserve_kernels import fp8_gemm_triton as fg
    from ftserve_kernels import fp8_gemv_triton as fv
    from ftserve_kernels import fp8_moe_gemv_triton as fmg
    from ftserve_kernels import fp8_moe_triton as fm
    from ftserve_kernels import fp8_quant as fq
    from ftserve_kernels import gemv_configs as gc
    from ftserve_kernels import gemv_triton as gemv
    from ftserve_kernels import oproj_route_triton as orr
    from tests.sm90_compile import _compile as compile_gemv
    from tests.sm90_compile import build_sm90, resources

    results: dict[str, dict[str, Any]] = {}
    f8, bf, f32, i32 = "*fp8e4nv", "*bf16", "*fp32", "*i32"

    def comp(name: str, fn: Any, types: dict[str, str], consts: dict[str, Any], warps: int, stages: int,
             aligned: tuple[str, ...] = ()) -> None:
        # Launch-time specialization: pointers, and the strides that are multiples of 16 at these shapes.
        types = {"bank": "i64", "map_ptr": i32, "miss_slot_ptr": i32, "miss_id_ptr": i32} | types
        k = build_sm90(fn, types, consts, warps, stages, aligned=aligned, all_strides=False)
        if isinstance(k, dict):  # reported, asserted on by the test
            results[name] = k
            return
        ptx = k.asm["ptx"]
        body = ptx[ptx.index(".entry"):]
        wait = body.find("griddepcontrol.wait")
        results[name] = resources(k)[0] | {
            "cp_async": "cp.async" in ptx,
            "fp8_wgmma": any("wgmma" in line and "e4m3" in line for line in ptx.splitlines()),
            "pdl_wait": wait >= 0,
            "loads_before_wait": body[:wait].count("ld.global") if wait >= 0 else -1}

    comp("act_quant", fq._act_quant_kernel, {"x_ptr": bf, "q_ptr": f8, "s_ptr": f32},
         dict(GROUP_K=fq.GROUP, BLOCK_T=8), 4, 1, ("stride_x", "stride_q"))
    gemm = {"a_ptr": f8, "as_ptr": f32, "b_ptr": f8, "bs_ptr": f32, "c_ptr": bf, "bias_ptr": bf}
    for m, bn in ((512, 128), (4096, 128), (4096, 64)):  # the two tiles; 64-row scale blocks (fused projections)
        c = fg.Fp8GemmConfig.pick(m, cuda=True)
        comp(f"gemm_m{c.block_m}" + (f"_bn{bn}" if bn != 128 else ""), fg._fp8_gemm_kernel, gemm,
             dict(SCALE_N=bn, SCALE_K=128, HAS_BIAS=False, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
                  BLOCK_K=fq.GROUP, GROUP_M=c.group_m, EVEN_K=True, UPCAST=False,
                  TILE_SCALE=bn % c.block_n == 0),  # as fp8_gemm_triton launches it
             c.num_warps, c.num_stages, ("stride_am", "stride_bn", "stride_cm"))
    moe = {"xq_ptr": f8, "xs_ptr": f32, "w_ptr": f8, "s_ptr": f32, "aq_ptr": f8, "as_ptr": f32, "y_ptr": bf,
           "weights_ptr": f32, "sorted_ptr": i32, "block_expert_ptr": i32, "total_ptr": i32}
    w13 = fq.Fp8Weight(torch.empty(0, 2 * INTER, H, dtype=fq.FP8, device="meta"),
                       torch.empty(0, 2 * INTER // 128, H // 128, device="meta"), 128, 128)
    tile_scale = fm.gate_up_tile_scale(w13, INTER)
    assert tile_scale
    for pairs in (4096 * K, 1024 * K, 16 * K):  # 128, 64 and 16-row tiles
        c = fm.Fp8MoeConfig.pick(pairs, E, cuda=True, tile_scale=tile_scale)
        common = dict(BLOCK_M=c.block_m, BLOCK_K=fq.GROUP, GROUP_M=c.group_m, EVEN_K=True, UPCAST=False,
                      SCALE_N=128, SCALE_K=128)
        for mapped in ((False, True) if c.block_m == 128 else (False,)):  # + an expert cache's slot map
            tag = f"m{c.block_m}" + ("_mapped" if mapped else "")
            comp(f"moe_gate_up_{tag}", fm._fp8_moe_gate_up_kernel, moe,
                 common | dict(TOP_K=K, BLOCK_N=fq.GROUP, HAS_MAP=mapped, OUT_DTYPE=tl.bfloat16,
                               TILE_SCALE=tile_scale),
                 c.num_warps, c.num_stages, ("stride_xq", "stride_we", "stride_wn", "stride_aq"))
            comp(f"moe_down_{tag}", fm._fp8_moe_down_kernel, moe,
                 common | dict(BLOCK_N=c.down_block_n, HAS_MAP=mapped, TILE_SCALE=128 % c.down_block_n == 0),
                 c.num_warps, c.num_stages, ("stride_aq", "stride_we", "stride_wn", "stride_y"))
    # The dense GEMV (gemv_triton's kernel, FP8) at its default launches, and the
    # bf16 one at the same shapes to compare with (regs, loads before the first FMA).
    g8 = {"x_ptr": bf, "w_ptr": f8, "s_ptr": f32, "b_ptr": bf, "y_ptr": bf, "parts_ptr": f32, "eps": "fp32"}
    parts_p = triton.next_power_of_2(H // fmg.moe_gemv_tiles(cuda=True)[1].block_n)  # the down's programs
    g16 = g8 | {"w_ptr": bf}
    for proj, n, k in (("qkv", 5120, H), ("o", H, 4096)):
        for t, pdl, parts in ((1, False, False), (2, False, False), (4, False, False), (1, True, False),
                              (1, True, proj == "qkv")):  # a pending norm: the next layer's qkv only
            cfg = gc.default("dense_fp8", True, n, t, k)
            tag = f"gemv_{proj}_t{t}" + ("_parts" if parts else "") + ("_pdl" if pdl else "")
            results[tag] = compile_gemv(gemv._gemv_kernel, g8, dict(
                HAS_BIAS=False, BLOCK_T=t, PDL=pdl, HAS_PARTS=parts, BLOCK_P=parts_p,
                **fv.launch_consts(k, 128, 128, cfg)), cfg.num_warps)
        cfg = gc.default("dense", True, n, 1)
        results[f"bf16_gemv_{proj}_t1"] = compile_gemv(gemv._gemv_kernel, g16, dict(
            HAS_BIAS=False, BLOCK_T=1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=True,
            K_STEPS=k // cfg.block_k), cfg.num_warps)
    cfg_gu, cfg_d = fmg.moe_gemv_tiles(cuda=True)
    bn_gu, bk_gu, warps_gu = cfg_gu.block_n, cfg_gu.block_k, cfg_gu.num_warps
    bn_d, bk, warps = cfg_d.block_n, cfg_d.block_k, cfg_d.num_warps
    gv = {"x_ptr": bf, "a_ptr": bf, "w_ptr": f8, "s_ptr": f32, "out_ptr": bf, "weights_ptr": f32, "ids_ptr": i32}
    fold = gv | {n: bf for n in ("res_ptr", "nw_ptr", "sum_ptr", "normed_ptr")} | {
        "cnt_ptr": i32, "part_ptr": f32, "eps": "fp32"}
    for defer in (False, True):  # the next layer's input norm in the epilogue: normed / left pending
        comp("moe_gemv_down_norm" + ("_defer" if defer else "") + "_pdl", fmg._fp8_down_kernel, fold,
             dict(TOP_K=K, BLOCK_KP=K, SCALE_N=128, SCALE_K=128, BLOCK_N=bn_d, BLOCK_K=bk, K_STEPS=INTER // bk,
                  EVEN_K=True, HAS_MAP=False, READ_THROUGH=False, BLOCK_M=2, PDL=True, NORM_NEXT=True,
                  NORM_DEFER=defer, BLOCK_H=H), warps, 1,
             ("stride_a", "stride_we", "stride_wn", "stride_o", "stride_rt"))
    # Without PDL, through tests/sm90_compile (registers, loads before the first FMA).
    results["moe_gemv_gate_up"] = compile_gemv(fmg._fp8_gate_up_kernel, gv, dict(
        TOP_K=K, SCALE_N=128, SCALE_K=128, BLOCK_N=bn_gu, BLOCK_K=bk_gu, K_STEPS=H // bk_gu, EVEN_K=True,
        SCALE_STEP=bk_gu <= 128), warps_gu)
    results["moe_gemv_down"] = compile_gemv(fmg._fp8_down_kernel, gv, dict(
        TOP_K=K, BLOCK_KP=K, SCALE_N=128, SCALE_K=128, BLOCK_N=bn_d, BLOCK_K=bk, K_STEPS=INTER // bk,
        EVEN_K=True), warps)
    # One decode row routed in its fp8 o_proj (oproj_route_triton at the dense_fp8
    # default for o_proj, router rows bf16), and the gate/up that applies its pending
    # norm and weighs the experts (RouteParts).
    cfg_o = gc.default("dense_fp8", True, H, 1, Q)
    bk_o, step_o = fv.k_step(Q, 128, cfg_o.block_k)
    route = ({n: bf for n in ("a_ptr", "bo_ptr", "r_ptr", "nw_ptr", "ro_ptr", "rr_ptr", "z_ptr", "scaled_ptr")}
             | {n: f32 for n in ("rb_ptr", "parts_ptr", "pre_ptr", "sel_ptr", "ws_ptr")}
             | {"wo_ptr": f8, "ids_ptr": i32, "cnt_ptr": i32})
    for pdl in (False, True):
        comp("oproj_route_fp8" + ("_pdl" if pdl else ""), orr._oproj_route_kernel, route,
             dict(HAS_BIAS=False, TOP_K=K, BLOCK_N=cfg_o.block_n, BLOCK_K=bk_o, K_STEPS=Q // bk_o,
                  N_STEPS=H // bk_o, BLOCK_E=2, BLOCK_EALL=E, BLOCK_TK=K, PDL=pdl, SCALE_N=128, SCALE_K=128,
                  FP8=True, SCALE_STEP=step_o),
             cfg_o.num_warps, cfg_o.num_stages, ("stride_wo", "stride_ro", "stride_rr"))
    routed = gv | {"parts_ptr": f32, "sel_ptr": f32, "wout_ptr": f32, "eps": "fp32"}
    gate_up_parts = dict(TOP_K=K, SCALE_N=128, SCALE_K=128, BLOCK_N=bn_gu, BLOCK_K=bk_gu, K_STEPS=H // bk_gu,
                         EVEN_K=True, SCALE_STEP=bk_gu <= 128, HAS_PARTS=True,
                         BLOCK_P=triton.next_power_of_2(H // cfg_o.block_n), BLOCK_TK=K)  # o_proj's programs
    results["moe_gemv_gate_up_parts"] = compile_gemv(fmg._fp8_gate_up_kernel, routed, gate_up_parts, warps_gu)
    comp("moe_gemv_gate_up_parts_pdl", fmg._fp8_gate_up_kernel, routed,
         gate_up_parts | dict(HAS_MAP=False, READ_THROUGH=False, BLOCK_M=2, PDL=True), warps_gu, 1,
         ("stride_x", "stride_we", "stride_wn", "stride_o"))
    for rt in (False, True):  # resident / an expert cache reading this step's misses from the bank
        tag = "_read_through" if rt else ""
        comp(f"moe_gemv_gate_up{tag}_pdl", fmg._fp8_gate_up_kernel, gv,
             dict(TOP_K=K, SCALE_N=128, SCALE_K=128, BLOCK_N=bn_gu, BLOCK_K=bk_gu, K_STEPS=H // bk_gu,
                  EVEN_K=True, SCALE_STEP=bk_gu <= 128, HAS_MAP=rt, READ_THROUGH=rt, BLOCK_M=16, PDL=True),
             warps_gu, 1,
             ("stride_x", "stride_we", "stride_wn", "stride_o"))
        comp(f"moe_gemv_down{tag}_pdl", fmg._fp8_down_kernel, gv,
             dict(TOP_K=K, BLOCK_KP=K, SCALE_N=128, SCALE_K=128, BLOCK_N=bn_d, BLOCK_K=bk, K_STEPS=INTER // bk,
                  EVEN_K=True, HAS_MAP=rt, READ_THROUGH=rt, BLOCK_M=16, PDL=True), warps, 1,
             ("stride_a", "stride_we", "stride_wn", "stride_o"))
    return results


def _compile_test_launches(prefill: bool) -> dict[str, dict[str, Any]]:
    """The fp8 kernel launches test_kernels_fp8.py makes on the GPU (tests/fp8_cases.py:
    its shapes, dtypes and explicit tiles; the launchers' CUDA tile choices and
    constexprs otherwise, PDL on as on Hopper), compiled for sm_90: {name: {} or
    {"error": ...}}: the activation quantizer and the decode kernels, whose K
    steps follow the test shapes (fp8_gemv_triton.k_step); with ``prefill`` also
    the w8a8 GEMM and the grouped expert GEMMs (``python
    tests/test_kernels_fp8_sm90_compile.py launches-all``; their tiles do not
    depend on K, the test above compiles them at the real shapes). The
    interpreter runs only the taken side of a constexpr branch; the compiler
    builds the code after an ``if`` that returns, so a dense fp8 GEMV step
    shorter than its scale column (BLOCK_K < SCALE_K: K 64 at 128-column blocks)
    failed only on the GPU."""
    import torch
    import triton
    import triton.language as tl

    from ftserve_kernels import fp8_gemm_triton as fg
    from ftserve_kernels import fp8_gemv_triton as fv
    from ftserve_kernels import fp8_moe_gemv_triton as fmg
    from ftserve_kernels import fp8_moe_triton as fm
    from ftserve_kernels import fp8_quant as fq
    from ftserve_kernels import gemv_configs as gc
    from ftserve_kernels import gemv_triton as gemv
    from ftserve_kernels import oproj_route_triton as orr
    from tests import fp8_cases as fc
    from tests.sm90_compile import build_sm90

    p2 = triton.next_power_of_2
    f8, f32, i32 = "*fp8e4nv", "*fp32", "*i32"
    ptr = {torch.float32: "*fp32", torch.bfloat16: "*bf16"}
    out: dict[str, dict[str, Any]] = {}

    def comp(name: str, fn: Any, types: dict[str, str], consts: dict[str, Any], warps: int, stages: int,
             ints: dict[str, int]) -> None:
        if name in out:
            return
        # As a launch specializes them: the integer arguments that are multiples of 16.
        aligned = tuple(n for n, v in ints.items() if v % 16 == 0)
        k = build_sm90(fn, {"eps": "fp32", "bank": "i64"} | types, consts, warps, stages, aligned=aligned,
                       all_strides=False)
        out[name] = k if isinstance(k, dict) else {}

    for dt in fc.DTYPES:  # test_activation_quantization_is_bit_exact
        comp(f"act_quant_{dt}", fq._act_quant_kernel, {"x_ptr": ptr[dt], "q_ptr": f8, "s_ptr": f32},
             dict(GROUP_K=fq.GROUP, BLOCK_T=8), 4, 1, dict(stride_x=300, stride_q=300, stride_s=3))

    n_d, h_d, e_d, i_d, k_d = fc.DISPATCH_SHAPE
    gemm_cases = [(dt, True, *case) for dt in fc.DTYPES for case in fc.GEMM_CASES]
    gemm_cases.append((torch.float32, False, 5, n_d, h_d, 128, 128))  # test_ops_dispatch_fp8_weights
    if not prefill:
        gemm_cases = []
    for dt, bias, m, n, k, bn, bk in gemm_cases:  # test_gemm_matches_twin: fp8_gemm_triton's launch
        c = fg.Fp8GemmConfig.pick(m, cuda=True)
        comp(f"gemm_{dt}_{m}x{n}x{k}_{bn}x{bk}_bias{bias}", fg._fp8_gemm_kernel,
             {"a_ptr": f8, "as_ptr": f32, "b_ptr": f8, "bs_ptr": f32, "c_ptr": ptr[dt],
              "bias_ptr": ptr[dt] if bias else f32},
             dict(SCALE_N=bn, SCALE_K=bk, HAS_BIAS=bias, BLOCK_M=c.block_m, BLOCK_N=c.block_n,
                  BLOCK_K=fq.GROUP, GROUP_M=c.group_m, EVEN_K=k % fq.GROUP == 0, UPCAST=False,
                  TILE_SCALE=bn % c.block_n == 0),
             c.num_warps, c.num_stages,
             dict(M=m, N=n, K=k, stride_am=k, stride_asm=-(-k // 128), stride_bn=k, stride_bsn=-(-k // bk),
                  stride_cm=n))

    def dense(tag: str, dt: torch.dtype, t: int, n: int, k: int, bn: int, bk: int, cfg: gc.GemvConfig,
              bias: bool, parts: int = 0) -> None:  # fp8_gemv_triton's launch
        types = {"x_ptr": ptr[dt], "w_ptr": f8, "s_ptr": f32, "b_ptr": ptr[dt],
                 "y_ptr": ptr[dt], "parts_ptr": f32}
        consts = dict(HAS_BIAS=bias, BLOCK_T=p2(t), PDL=True, **fv.launch_consts(k, bn, bk, cfg))
        if parts:
            consts |= dict(HAS_PARTS=True, BLOCK_P=p2(parts))
        comp(f"gemv_{tag}_{dt}_t{t}_{n}x{k}_{bn}x{bk}_{cfg.block_n}x{cfg.block_k}_bias{bias}_parts{parts}",
             gemv._gemv_kernel, types, consts, cfg.num_warps, cfg.num_stages,
             dict(T=t, N=n, K=k, P=parts, stride_x=k, stride_w=k, stride_y=n, stride_s=-(-k // bk)))

    for dt in fc.DTYPES:  # test_gemv_matches_exact_reference: the dense_fp8 default
        for t, n, k, bn, bk in fc.GEMV_CASES:
            for bias in (True, False):
                dense("exact", dt, t, n, k, bn, bk, gc.default("dense_fp8", True, n, t, k), bias)
    for t, n, k, bk, tiles in fc.GEMV_TILE_CASES:  # test_gemv_tiles_against_scale_blocks
        dense("tiles", torch.float32, t, n, k, fc.GEMV_TILE_BN, bk, gc.GemvConfig(*tiles, 1, 1), False)
    e, h, inter, k = fc.MOE_GEMV_SHAPE
    cfg_d = fmg.moe_gemv_tiles(cuda=True)[1]
    for t in fc.NORM_NEXT_TOKENS:  # test_moe_gemv_folds_the_next_norm: a 96-row GEMV applies the pending norm
        dense("parts", torch.float32, t, 96, h, 128, 128, gc.default("dense_fp8", True, 96, t, h), False,
              parts=-(-h // cfg_d.block_n))
    for t in fc.DISPATCH_TOKENS[:2]:  # test_ops_dispatch_fp8_weights: the GEMV up to 4 rows
        dense("dispatch", torch.float32, t, n_d, h_d, 128, 128, gc.default("dense_fp8", True, n_d, t, h_d), False)

    def route(dt: torch.dtype, h: int, q: int, bn: int, bk: int, bias: bool, cfg: gc.GemvConfig, e: int,
              top_k: int) -> None:  # oproj_route_triton's launch over an fp8 o_proj
        bk_, step = fv.k_step(q, bk, cfg.block_k)
        types = {n: ptr[dt] for n in ("a_ptr", "r_ptr", "nw_ptr", "ro_ptr", "rr_ptr", "z_ptr", "scaled_ptr")}
        types |= {n: f32 for n in ("parts_ptr", "pre_ptr", "sel_ptr", "ws_ptr")}
        types |= {"bo_ptr": ptr[dt] if bias else f8, "rb_ptr": f32 if bias else ptr[dt]}  # unread stand-ins
        comp(f"oproj_route_{dt}_{h}x{q}_{bn}x{bk}_{cfg.block_n}x{cfg.block_k}_bias{bias}", orr._oproj_route_kernel,
             types | {"wo_ptr": f8, "ids_ptr": i32, "cnt_ptr": i32},
             dict(HAS_BIAS=bias, TOP_K=top_k, BLOCK_N=cfg.block_n, BLOCK_K=bk_, K_STEPS=-(-q // bk_),
                  N_STEPS=-(-h // bk_), BLOCK_E=2, BLOCK_EALL=p2(e), BLOCK_TK=p2(top_k), PDL=True, SCALE_N=bn,
                  SCALE_K=bk, FP8=True, SCALE_STEP=step),
             cfg.num_warps, cfg.num_stages,
             dict(N=h, K=q, E=e, PE=-(-e // 2), stride_wo=q, stride_ro=q, stride_rr=h, stride_ws=-(-q // bk)))

    for dt, h_r, q, bn, bk, bias, tiles in fc.ROUTE_CASES:  # test_oproj_route_fp8_matches_its_twin
        cfg = gc.GemvConfig(*tiles, 4, 1)
        route(dt, h_r, q, bn, bk, bias, cfg, *fc.ROUTE_E_K)
        dense("route", dt, 1, h_r, q, bn, bk, cfg, bias)  # ... and the unfused fp8 GEMV it is checked against
    e_r, h_r, q, i_r, k_r = fc.ROUTED_SHAPE  # test_fp8_experts_take_the_route_parts: the default tiles
    cfg_o = gc.default("dense_fp8", True, h_r, 1, q)
    route(torch.float32, h_r, q, 128, 128, False, cfg_o, e_r, k_r)

    def pair(tag: str, dt: torch.dtype, t: int, e: int, h: int, inter: int, k: int, bn13: int,
             tiles: tuple[gc.GemvConfig, gc.GemvConfig], mapped: bool = False, norm: tuple[bool, ...] = (),
             route_parts: int = 0) -> None:  # fp8_moe_gemv_triton._launch
        sn13, sk13, sn2, sk2 = (1, h, 1, inter) if bn13 == 0 else (bn13, 128, 128, 128)
        cfg_gu, cfg_d = tiles
        bk_gu, step_gu = fv.k_step(h, sk13, cfg_gu.block_k)
        bk_d = min(cfg_d.block_k, fq.GROUP, p2(inter))
        common = dict(HAS_MAP=mapped, READ_THROUGH=False, BLOCK_M=2, PDL=True)
        gv = {"x_ptr": ptr[dt], "a_ptr": ptr[dt], "w_ptr": f8, "s_ptr": f32, "out_ptr": ptr[dt],
              "weights_ptr": f32, "ids_ptr": i32, "map_ptr": i32, "miss_slot_ptr": i32, "miss_id_ptr": i32}
        routed = {}
        if route_parts:
            routed = dict(HAS_PARTS=True, BLOCK_P=p2(route_parts), BLOCK_TK=p2(k))
            gv |= {"parts_ptr": f32, "sel_ptr": f32, "wout_ptr": f32}
        base = f"{dt}_t{t}_e{e}_h{h}_i{inter}_k{k}_bn{bn13}_map{mapped}"
        comp(f"moe_gemv_gate_up_{tag}_{base}_{cfg_gu.block_n}x{bk_gu}_parts{route_parts}", fmg._fp8_gate_up_kernel,
             gv, dict(TOP_K=k, SCALE_N=sn13, SCALE_K=sk13, BLOCK_N=cfg_gu.block_n, BLOCK_K=bk_gu,
                      K_STEPS=-(-h // bk_gu), EVEN_K=h % bk_gu == 0, SCALE_STEP=step_gu, **routed, **common),
             cfg_gu.num_warps, 1,
             dict(H=h, INTER=inter, stride_x=h, stride_we=2 * inter * h, stride_wn=h, stride_o=inter, P=route_parts,
                  stride_se=-(-2 * inter // sn13) * -(-h // sk13), stride_sn=-(-h // sk13)))
        for fold in norm or (None,):
            consts = dict(TOP_K=k, BLOCK_KP=p2(k), SCALE_N=sn2, SCALE_K=sk2, BLOCK_N=cfg_d.block_n, BLOCK_K=bk_d,
                          K_STEPS=-(-inter // bk_d), EVEN_K=inter % bk_d == 0, **common)
            types = dict(gv)
            if fold is not None:
                consts |= dict(NORM_NEXT=True, NORM_DEFER=fold, BLOCK_H=p2(h))
                types |= {"res_ptr": ptr[dt], "nw_ptr": ptr[dt], "sum_ptr": ptr[dt], "normed_ptr": ptr[dt],
                          "cnt_ptr": i32, "part_ptr": f32}
            comp(f"moe_gemv_down_{tag}_{base}_{cfg_d.block_n}x{bk_d}_norm{fold}", fmg._fp8_down_kernel, types,
                 consts, cfg_d.num_warps, 1,
                 dict(H=h, INTER=inter, stride_a=inter, stride_we=h * inter, stride_wn=inter, stride_o=h,
                      stride_rt=h, stride_se=-(-h // sn2) * -(-inter // sk2), stride_sn=-(-inter // sk2)))

    cuda_tiles = fmg.moe_gemv_tiles(cuda=True)
    for dt, t, bn13 in fc.MOE_GEMV_CASES:  # test_moe_gemv_matches_exact_reference, with and without a slot map
        for mapped in (False, True):
            pair("exact", dt, t, e, h, inter, k, bn13, cuda_tiles, mapped)
    for t in fc.NORM_NEXT_TOKENS:  # test_moe_gemv_folds_the_next_norm
        pair("norm", torch.float32, t, e, h, inter, k, 64, cuda_tiles, norm=(False, True))
    wide = (gc.GemvConfig(*fc.WIDE_TILES[0]), gc.GemvConfig(*fc.WIDE_TILES[1]))
    for dt, h_w in fc.WIDE_CASES:  # test_moe_gemv_gate_up_steps_across_scale_blocks
        pair("wide", dt, 1, fc.WIDE_SHAPE[0], h_w, fc.WIDE_SHAPE[1], fc.WIDE_SHAPE[2], 64, wide)
    for parts in (0, -(-h_r // cfg_o.block_n)):  # test_fp8_experts_take_the_route_parts: routed, and unrouted
        pair("routed", torch.float32, 1, e_r, h_r, i_r, k_r, 64, cuda_tiles, norm=(False, True), route_parts=parts)
    for t in [t for t in fc.DISPATCH_TOKENS if t <= 2]:  # test_ops_dispatch_fp8_weights: the pair up to 2 tokens
        pair("dispatch", torch.float32, t, e_d, h_d, i_d, k_d, 128, cuda_tiles)

    moe = {"xq_ptr": f8, "xs_ptr": f32, "w_ptr": f8, "s_ptr": f32, "aq_ptr": f8, "as_ptr": f32,
           "weights_ptr": f32, "sorted_ptr": i32, "block_expert_ptr": i32, "total_ptr": i32, "map_ptr": i32}
    grouped = [(dt, t, e_g, h_g, i_g, k_g, bn13) for dt, t, e_g, h_g, i_g, k_g, bn13 in fc.GROUPED_MOE_CASES]
    grouped += [(torch.float32, t, e_d, h_d, i_d, k_d, 128) for t in fc.DISPATCH_TOKENS if t > 2]
    if not prefill:
        grouped = []
    for dt, t, e_g, h_g, i_g, k_g, bn13 in grouped:  # test_grouped_moe_matches_twin: fused_moe_fp8_triton
        sn13, sk13, sn2, sk2 = (1, h_g, 1, i_g) if bn13 == 0 else (bn13, 128, 128, 128)
        tile_scale = sn13 % fq.GROUP == 0 and i_g % fq.GROUP == 0  # fp8_moe_triton.gate_up_tile_scale
        c = fm.Fp8MoeConfig.pick(t * k_g, e_g, cuda=True, tile_scale=tile_scale)
        common = dict(BLOCK_M=c.block_m, BLOCK_K=fq.GROUP, GROUP_M=c.group_m, UPCAST=False)
        for mapped in (False, True):
            base = f"{dt}_t{t}_e{e_g}_h{h_g}_i{i_g}_k{k_g}_bn{bn13}_map{mapped}"
            comp(f"moe_gate_up_{base}", fm._fp8_moe_gate_up_kernel, moe,
                 common | dict(TOP_K=k_g, SCALE_N=sn13, SCALE_K=sk13, BLOCK_N=fq.GROUP, EVEN_K=h_g % fq.GROUP == 0,
                               HAS_MAP=mapped, OUT_DTYPE={torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}[dt],
                               TILE_SCALE=tile_scale),
                 c.num_warps, c.num_stages,
                 dict(N=t * k_g, H=h_g, INTER=i_g, stride_xq=h_g, stride_we=2 * i_g * h_g, stride_wn=h_g,
                      stride_aq=i_g))
            comp(f"moe_down_{base}", fm._fp8_moe_down_kernel, moe | {"y_ptr": ptr[dt]},
                 common | dict(SCALE_N=sn2, SCALE_K=sk2, BLOCK_N=c.down_block_n, EVEN_K=i_g % fq.GROUP == 0,
                               HAS_MAP=mapped, TILE_SCALE=sn2 % c.down_block_n == 0),
                 c.num_warps, c.num_stages,
                 dict(N=t * k_g, H=h_g, INTER=i_g, stride_aq=i_g, stride_we=h_g * i_g, stride_wn=i_g, stride_y=h_g))
    return out


def test_fp8_test_launches_compile_for_sm90() -> None:
    """The quantizer and decode-kernel launches test_kernels_fp8.py makes on the
    GPU compile for sm_90 (_compile_test_launches)."""
    results = compile_in_child([os.path.abspath(__file__), "launches"], timeout=900)
    for family in ("act_quant_", "gemv_exact_", "gemv_tiles_", "gemv_parts_", "oproj_route_", "moe_gemv_gate_up_",
                   "moe_gemv_down_"):
        assert any(name.startswith(family) for name in results), (family, sorted(results))
    errors = {k: v["error"] for k, v in results.items() if "error" in v}
    assert not errors, errors


def test_fp8_kernels_compile_for_sm90() -> None:
    results = compile_in_child([os.path.abspath(__file__)], timeout=900)
    errors = {k: v["error"] for k, v in results.items() if "error" in v}
    assert not errors, errors
    for name, r in results.items():
        assert r["shared"] <= SMEM_LIMIT, (name, r)
        assert r["local"] in (0, -1), f"{name} uses local memory: {r}"
        assert r["loop_spills"] in (0, -1), f"{name} spills registers inside a loop: {r}"
        if not name.startswith(("gemv_", "moe_gemv_")):  # the prefill kernels (issue 32: they spilled)
            assert r["stack"] <= MAX_STACK, f"{name} spills registers: {r}"
    for name in ("gemm_m64", "gemm_m128", "gemm_m128_bn64", "moe_gate_up_m64", "moe_gate_up_m128", "moe_down_m64",
                 "moe_down_m128", "moe_gate_up_m128_mapped"):
        assert results[name]["fp8_wgmma"], f"{name} does not multiply e4m3 on wgmma: {results[name]}"
        assert results[name]["cp_async"], f"{name} loads are not pipelined: {results[name]}"
    # Below the wgmma's 64 rows (few pairs an expert: a short eager chunk, a decode
    # batch of 3-8) Triton converts the codes to f16 for mma.sync's fp32 sums: the two
    # tilings round differently (test_gpu_fp8's docstring: prefill graphs vs eager).
    for name in ("moe_gate_up_m16", "moe_down_m16"):
        assert not results[name]["fp8_wgmma"], f"{name} multiplies e4m3 on wgmma: {results[name]}"
    for name, r in results.items():
        assert r["pdl_wait"] == name.endswith("_pdl"), (name, r)
        if r["pdl_wait"] and name.startswith(("moe_", "oproj_route")):
            # Every load after the wait: the expert ids (and the slots read-through
            # writes) come from the kernels before; o_proj's input is the attention's.
            assert r["loads_before_wait"] == 0, (name, r)
        elif r["pdl_wait"]:  # the dense GEMV's first weight tile loads ahead of it
            assert r["loads_before_wait"] > 0, (name, r)
    # The dense fp8 GEMV's unrolled K loop issues its weight loads ahead, as the
    # bf16 GEMV's does (tests/sm90_compile.py counts the loads before the first FMA).
    for name in ("gemv_qkv_t1", "gemv_o_t1", "gemv_qkv_t1_pdl", "gemv_o_t1_pdl", "gemv_qkv_t2", "gemv_o_t2",
                 "moe_gemv_gate_up", "moe_gemv_gate_up_parts", "moe_gemv_down"):
        n = results[name]["loads_before_first_use"]
        assert n == -1 or n >= 8, f"{name}: only {n} loads issued before the first FMA: {results[name]}"


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] in (["launches"], ["launches-all"]):
        print(json.dumps(_compile_test_launches(prefill=sys.argv[1] == "launches-all")))
    else:
        print(json.dumps(_compile_all()))
