"""Compile the decode-path GEMV kernels for Hopper (sm_90) without a GPU and
report registers, spills and how the weight loads are issued.

Usage: python -m tests.sm90_compile  (prints one JSON line; run it
without TRITON_INTERPRET). tests/test_kernels_moe.py runs it in a subprocess.

The GEMV kernels stream weights with plain loads (not cp.async-pipelined), so
what hides memory latency is how many loads a thread issues before its first
use of one. ``loads_before_first_use`` counts the LDG instructions before the
first FFMA in the SASS (-1 when cuobjdump is missing): unrolled K loops free of
barriers let ptxas issue many of them up front.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ftserve_kernels import decode_fused_triton as df
from ftserve_kernels import gemv_configs as gc
from ftserve_kernels import gemv_triton as gv
from ftserve_kernels import moe_down_gemv_triton as md
from ftserve_kernels import moe_gemv_triton as mg

# Integer arguments the launch specializes as multiples of 16 at the real shapes.
_DIV16 = ("H", "K", "N", "E", "INTER", "bank_col")



def compile_in_child(args: list[str], timeout: int) -> Any:
    """Run ``python *args`` from the repository root with the real Triton compiler
    (the calling test runs under the interpreter) and return the JSON of its last
    stdout line: how the offline sm_90 compile tests get their results. Skips
    where triton lacks the nvidia backend, or where a GPU is present (the gpu
    tests compile and run the kernels for real there)."""
    import sys

    import pytest
    import torch

    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError:
        pytest.skip("triton without the nvidia backend")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the gpu-marked tests compile and run the kernels for real")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, *args], env=env, cwd=root, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_BRANCH = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA(?:\.\w+)*\s+0x([0-9a-f]+)")
_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*)")


def loop_spills(sass: str) -> int:
    """Spill stores and loads (STL / LDL) between a backward branch and its
    target: register traffic to local memory inside a loop, once per iteration."""
    lines = [(int(m.group(1), 16), m.group(2)) for m in map(_ADDR.search, sass.splitlines()) if m]
    loops = [(int(m.group(2), 16), int(m.group(1), 16)) for m in map(_BRANCH.search, sass.splitlines())
             if m and int(m.group(2), 16) < int(m.group(1), 16)]
    return sum(1 for addr, ins in lines if re.search(r"\b(STL|LDL)\b", ins)
               and any(lo <= addr <= hi for lo, hi in loops))


def _usage(res: dict[str, Any], usage: str, sass: str) -> None:
    """cuobjdump's resource line into ``res``: regs, stack (the frame ptxas spills
    registers to), local (local arrays; not spills), loop_spills (from the SASS)."""
    for word in usage.split():
        key, _, val = word.partition(":")
        if key in ("REG", "STACK", "LOCAL") and val.isdigit():
            res[{"REG": "regs", "STACK": "stack", "LOCAL": "local"}[key]] = int(val)
    res["loop_spills"] = loop_spills(sass)


def constexpr_defaults(fn: Any) -> dict[str, Any]:
    """A kernel's constexpr parameters that have defaults, at those defaults: a
    harness that names only what it changes still compiles them as constants
    (a name left out would become a runtime argument, and both branches of
    every ``if`` on it would be compiled)."""
    return {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}


def build_sm90(fn: Any, types: dict[str, str], consts: dict[str, Any], warps: int, stages: int,
               aligned: tuple[str, ...] = (), all_strides: bool = True) -> Any:
    """triton.compile of one kernel for sm_90 as its launch would specialize it:
    pointers, the strides (all, or with ``all_strides=False`` those named) and the
    arguments named in ``aligned`` as multiples of 16; every other argument named in ``types`` or an i32. Returns
    the compiled kernel, or {"error": ...} where it does not compile (an
    out-of-shared-memory kernel fails here, as its launch would)."""
    consts = {k: v for k, v in (constexpr_defaults(fn) | consts).items() if k in fn.arg_names}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (sig[n].startswith("*") or (all_strides and "stride" in n) or n in aligned)}
    try:
        return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    except Exception as exc:  # reported; the test asserts on it
        return {"error": f"{type(exc).__name__}: {exc}"[:2000]}


def resources(k: Any) -> tuple[dict[str, Any], str]:
    """({"shared", "regs", "local", "stack", "loop_spills"}, the SASS) of a compiled
    kernel; -1 and "" where cuobjdump is missing."""
    res: dict[str, Any] = {"shared": k.metadata.shared, "regs": -1, "local": -1, "stack": -1, "loop_spills": -1}
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return res, ""
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    try:
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    _usage(res, usage, sass)
    return res, sass


def compile_sm90(fn: Any, types: dict[str, str], consts: dict[str, Any], warps: int,
                 stages: int) -> dict[str, Any]:
    """build_sm90, then its resources: {"shared": bytes, "regs", "local", "stack",
    "loop_spills"}, or {"error": ...}."""
    k = build_sm90(fn, types, consts, warps, stages)
    return k if isinstance(k, dict) else resources(k)[0]


def _compile(fn: Any, types: dict[str, str], consts: dict[str, Any], warps: int) -> dict[str, Any]:
    """A decode GEMV (2 stages, the expert-cache arguments typed): its resources,
    PDL placement, 16-byte loads and the weight loads issued before the first FMA."""
    consts = {"HAS_MAP": False, "PDL": False, "READ_THROUGH": False, "BLOCK_M": 1} | constexpr_defaults(fn) | consts
    types = {"map_ptr": "*i32", "bank": "i64", "miss_slot_ptr": "*i32", "miss_id_ptr": "*i32"} | types
    k = build_sm90(fn, types, consts, warps, 2, aligned=_DIV16)
    if isinstance(k, dict):
        return k
    res, sass = resources(k)
    body = k.asm["ptx"][k.asm["ptx"].index(".entry"):]
    wait = body.find("griddepcontrol.wait")
    res |= {"loads_before_first_use": -1, "pdl_wait": wait >= 0,
            "pdl_release": "griddepcontrol.launch_dependents" in body,
            # PTX loads ahead of the wait: weights in flight early (pdl.py)
            "loads_before_wait": body[:wait].count("ld.global") if wait >= 0 else -1,
            # 16-byte loads (what UVA reads from the host bank need to near PCIe speed)
            "v4_loads": body.count("ld.global.v4") + body.count("ld.global.L1::evict_last.v4")}
    if sass:
        n = 0
        for line in sass.splitlines():
            if " FFMA" in line:
                break
            n += " LDG" in line
        res["loads_before_first_use"] = n
    return res


def compile_all() -> dict[str, dict[str, Any]]:
    bf, i32 = "*bf16", "*i32"
    moe = {"x_ptr": bf, "a_ptr": bf, "w_ptr": bf, "out_ptr": bf, "weights_ptr": "*fp32", "ids_ptr": i32}
    out: dict[str, dict[str, Any]] = {}
    out["moe_gate_up"] = _compile(mg._gemv_gate_up_kernel, moe,
                                  dict(TOP_K=8, BLOCK_N=16, BLOCK_K=512, EVEN_K=True), 8)
    out["moe_down3d"] = _compile(md._gemv_down_combine3d_kernel, moe,
                                 dict(TOP_K=8, BLOCK_KP=8, BLOCK_N=8, BLOCK_K=256, EVEN_K=True,
                                      K_STEPS=3), 8)
    out["moe_down3d_norm"] = _compile(  # the next layer's input norm in the epilogue
        md._gemv_down_combine3d_kernel, moe | {"res_ptr": bf, "nw_ptr": bf, "sum_ptr": bf, "normed_ptr": bf,
                                               "cnt_ptr": i32, "eps": "fp32"},
        dict(TOP_K=8, BLOCK_KP=8, BLOCK_N=4, BLOCK_K=128, EVEN_K=True, K_STEPS=6, NORM_NEXT=True,
             BLOCK_H=2048), 8)
    # Read-through (moe/cache.py): this step's expert-cache misses read from the host bank.
    rt = dict(READ_THROUGH=True, BLOCK_M=8, HAS_MAP=True)
    out["moe_gate_up_rt"] = _compile(mg._gemv_gate_up_kernel, moe,
                                     dict(TOP_K=8, BLOCK_N=16, BLOCK_K=512, EVEN_K=True, **rt), 8)
    out["moe_down3d_rt"] = _compile(md._gemv_down_combine3d_kernel, moe,
                                    dict(TOP_K=8, BLOCK_KP=8, BLOCK_N=8, BLOCK_K=256, EVEN_K=True,
                                         K_STEPS=3, **rt), 8)
    route = {"x_ptr": bf, "r_ptr": bf, "nw_ptr": bf, "g_ptr": bf, "normed_ptr": bf, "sum_ptr": bf,
             "logits_ptr": "*fp32", "w_out_ptr": "*fp32", "ids_out_ptr": i32, "cnt_ptr": i32,
             "eps": "fp32"}
    # At the launch's choices (add_norm_route_triton): qwen3-30b-a3b (H 2048, 128
    # experts, top-8) and qwen3-next (512 experts, top-10) at the default one
    # router row a program, and 4 rows a program (route_warps widens the program).
    for name, e, k, be in (("add_norm_route", 128, 8, 1), ("add_norm_route_next", 512, 10, 1),
                           ("add_norm_route_be4", 128, 8, 4)):
        out[name] = _compile(
            df._add_norm_route_kernel, route,
            dict(HAS_RESIDUAL=True, TOP_K=k, RENORM=True, BLOCK_E=be, BLOCK_H=2048,
                 BLOCK_EALL=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(k)),
            df.route_warps(be, 2048))
    g = {"x_ptr": bf, "w_ptr": bf, "b_ptr": bf, "y_ptr": bf, "eps": "fp32"}
    for t in (1, 2, 4):  # the default blocks gemv_triton picks at each row count
        out[f"gemv_qkv_T{t}"] = _compile(
            gv._gemv_kernel, g,
            dict(HAS_BIAS=False, BLOCK_T=t, BLOCK_N=16 if t <= 2 else 8, BLOCK_K=256, EVEN_K=True,
                 K_STEPS=8), 8)
        out[f"gemv_o_T{t}"] = _compile(
            gv._gemv_kernel, g,
            dict(HAS_BIAS=False, BLOCK_T=t, BLOCK_N=8, BLOCK_K=256, EVEN_K=True, K_STEPS=16), 8)
    # Dense decode layers (models with a DenseMLP): gate/up with the GLU epilogue over
    # the post-attention norm left pending (HAS_PARTS), o_proj and down adding the
    # residual and leaving the next norm pending (NORM_DEFER), at the default blocks
    # gemv_triton picks: SmolLM2-135M (H 576, I 1536) and an 8B-class shape (H 4096,
    # I 14336: a down GEMV of 56 unrolled K steps).
    for name, n, k, t in (("smollm", 3072, 576, 1), ("smollm", 3072, 576, 2), ("smollm", 3072, 576, 4),
                          ("8b", 28672, 4096, 1), ("8b", 28672, 4096, 4)):
        parts = -(-k // gc.default("dense", True, k, t).block_n)  # o_proj's programs (N = k) left them
        out[f"gemv_glu_{name}_T{t}"] = _compile(
            gv._gemv_kernel, g | {"parts_ptr": "*fp32"},
            dict(HAS_BIAS=False, BLOCK_T=t, BLOCK_N=gc.default("dense", True, n, t).block_n, BLOCK_K=256,
                 EVEN_K=k % 256 == 0, K_STEPS=-(-k // 256), GLU=True, HAS_PARTS=True,
                 BLOCK_P=triton.next_power_of_2(parts)), 8)
    norm_out = g | {"res_ptr": bf, "nw_ptr": bf, "sum_ptr": bf, "part_out_ptr": "*fp32"}
    for name, n, k, t in (("smollm_o", 576, 576, 1), ("smollm_down", 576, 1536, 1), ("smollm_down", 576, 1536, 4),
                          ("8b_down", 4096, 14336, 1), ("8b_down", 4096, 14336, 4)):
        out[f"gemv_add_norm_{name}_T{t}"] = _compile(
            gv._gemv_kernel, norm_out,
            dict(HAS_BIAS=False, BLOCK_T=t, BLOCK_N=gc.default("dense", True, n, t).block_n, BLOCK_K=256,
                 EVEN_K=k % 256 == 0, K_STEPS=-(-k // 256), NORM_DEFER=True), 8)
    out["gemv_glu_smollm_T1_pdl"] = _compile(
        gv._gemv_kernel, g | {"parts_ptr": "*fp32"},
        dict(HAS_BIAS=False, BLOCK_T=1, BLOCK_N=8, BLOCK_K=256, EVEN_K=False, K_STEPS=3, GLU=True, HAS_PARTS=True,
             BLOCK_P=128, PDL=True), 8)
    out["gemv_add_norm_8b_down_T1_pdl"] = _compile(  # as it launches on sm_90 (PDL on)
        gv._gemv_kernel, norm_out,
        dict(HAS_BIAS=False, BLOCK_T=1, BLOCK_N=16, BLOCK_K=256, EVEN_K=True, K_STEPS=56, NORM_DEFER=True, PDL=True), 8)
    out["gemv_add_norm_smollm_down_T1_pdl"] = _compile(
        gv._gemv_kernel, norm_out,
        dict(HAS_BIAS=False, BLOCK_T=1, BLOCK_N=8, BLOCK_K=256, EVEN_K=True, K_STEPS=6, NORM_DEFER=True, PDL=True), 8)
    # PDL launches: the gemv and the router load weights before the wait,
    # the MoE GEMVs read the router's ids first, so nothing of theirs comes before it.
    out["gemv_o_T1_pdl"] = _compile(
        gv._gemv_kernel, g,
        dict(HAS_BIAS=False, BLOCK_T=1, BLOCK_N=8, BLOCK_K=256, EVEN_K=True, K_STEPS=16, PDL=True), 8)
    out["gemv_qkv_T2_pdl"] = _compile(
        gv._gemv_kernel, g,
        dict(HAS_BIAS=False, BLOCK_T=2, BLOCK_N=16, BLOCK_K=256, EVEN_K=True, K_STEPS=8, PDL=True), 8)
    out["add_norm_route_pdl"] = _compile(
        df._add_norm_route_kernel, route,
        dict(HAS_RESIDUAL=True, TOP_K=8, RENORM=True, BLOCK_E=1, BLOCK_H=2048, BLOCK_EALL=128,
             BLOCK_K=8, PDL=True), df.route_warps(1, 2048))
    out["moe_gate_up_pdl"] = _compile(mg._gemv_gate_up_kernel, moe,
                                      dict(TOP_K=8, BLOCK_N=16, BLOCK_K=512, EVEN_K=True, PDL=True), 8)
    out["moe_down3d_pdl"] = _compile(md._gemv_down_combine3d_kernel, moe,
                                     dict(TOP_K=8, BLOCK_KP=8, BLOCK_N=8, BLOCK_K=256, EVEN_K=True,
                                          K_STEPS=3, PDL=True), 8)
    return out


if __name__ == "__main__":
    print(json.dumps(compile_all()))
