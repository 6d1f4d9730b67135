"""CI: the installed wheel carries its Metal kernels, and each passes its first-use self-check under the emulator.

    python .ci/check_installed.py --repo CHECKOUT

Run by .ci/run with the wheel installed (not editable) in a fresh venv, from a directory outside the
checkout, with PYTHONPATH holding only a copy of tests/emulator (as the package `emulator`). Fails unless
tq_mlx and its .metal sources come from site-packages, the emulator compiles exactly those sources, and every
kernel (rotate, encode, dequantize, decode_attention, prefill_attention) passes its self-check and agrees with the reference.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import warnings
from pathlib import Path


def fail(msg: str) -> None:
    print(f"check_installed: FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repo", type=Path, required=True, help="the checkout, which nothing may be imported from")
    repo = p.parse_args().repo.resolve()

    import numpy as np

    import mlx.core as mx
    import tq_mlx
    from tq_mlx import attention as K
    from tq_mlx.batch import learned
    from tq_mlx.cache import TurboQuantConfig, TurboQuantKVCache

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    pkg = Path(tq_mlx.__file__).resolve().parent
    if pkg.parent != site or pkg.is_relative_to(repo):
        fail(f"tq_mlx imported from {pkg}, not from {site}")
    metal_dir = pkg / "attention"
    installed = {f.stem: f.read_text() for f in sorted(metal_dir.glob("*.metal"))}
    if set(installed) != set(K.KERNEL_NAMES):
        fail(f"{metal_dir} holds {sorted(installed)}, expected {sorted(K.KERNEL_NAMES)}")
    if K.SOURCES != installed:
        fail(f"tq_mlx.attention.SOURCES is not the text of {metal_dir}")
    print(f"kernel sources: {len(installed)} files in {metal_dir}")

    import emulator  # a copy of tests/emulator

    if Path(emulator.__file__).resolve().is_relative_to(repo):
        fail("the emulator must be imported from a copy, so the checkout stays off sys.path")
    compiler = emulator.find_compiler()
    if compiler is None:
        fail("no C++ compiler for the emulator (clang++ >= 17 or the ziglang package)")
    print(f"emulator compiler: {' '.join(compiler.argv)} ({compiler.version})")

    built: list[str] = []

    def factory(**make):
        # the emulator must compile exactly the installed text
        name = make["name"].removeprefix("tq_")
        if make["source"] != installed[name] or make["header"] != installed["common"]:
            fail(f"kernel {name} was not built from {metal_dir / (name + '.metal')}")
        built.append(name)
        return emulator.metal_kernel(**make)

    K.set_backend("metal")
    K.set_kernel_factory(factory)
    K.reset_self_checks()
    rng = np.random.default_rng(0)
    normal = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.float16)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a failed self-check warns: make it fatal
        # (prefill not read as decode: these views are read by queries of any count, as the cache holds them)
        cache = TurboQuantKVCache(TurboQuantConfig(key_bits=4, value_bits=4, window=16, calibration_tokens=None, sinks=4, prefill_as_decode=False),
                                  head_dim=64)
        keys, values = cache.update_and_fetch(normal(1, 2, 60, 64), normal(1, 2, 60, 64))  # encode
        if not keys.n_coded:
            fail("the cache compressed no token: encode never ran")
        q = normal(1, 4, 1, 64)
        keys, values = learned(q, keys, values, 0.125)  # the caches learn from the queries first, as the hook does
        checks = [
            ("decode_attention", K.dispatch_attention(q, keys, values, 0.125),
             K.decode_attention_reference(q, keys, values, 0.125)),
            ("dequantize", K.dispatch_dequantize(keys), K.dequantize_reference(keys)),
        ]
        qp = normal(1, 4, 12, 64)  # a 12-token chunk over the compressed context: prefill_attention
        checks.append(("prefill_attention", K.dispatch_attention(qp, keys, values, 0.125, "causal"),
                       K.prefill_attention_reference(qp, keys, values, 0.125, "causal")))
        # Channel groups and a head dim without a power-of-two WHT: encode_dense, then attention with the value
        # rotation done by the host.
        cache = TurboQuantKVCache(TurboQuantConfig(key_bits=3.5, value_bits=2.5, window=16, calibration_tokens=None, sinks=4,
                                                   prefill_as_decode=False), head_dim=96)
        k96, v96 = cache.update_and_fetch(normal(1, 2, 60, 96), normal(1, 2, 60, 96))
        if not k96.n_coded or k96.perm is None:
            fail("the 3.5/2.5-bit cache compressed no token with a channel order")
        q96 = normal(1, 4, 1, 96)
        k96, v96 = learned(q96, k96, v96, 0.1)
        checks.append(("decode_attention K3.5/V2.5 d96", K.dispatch_attention(q96, k96, v96, 0.1),
                       K.decode_attention_reference(q96, k96, v96, 0.1)))
        # the default's prefill, read as decode: a 60-token chunk through the kernels run by run (16 queries a
        # run: prefill_attention), against the reference run by run
        cache = TurboQuantKVCache(TurboQuantConfig(key_bits=4, value_bits=4, window=16, calibration_tokens=None, sinks=4, compress_block=16),
                                  head_dim=64)
        kd, vd = cache.update_and_fetch(normal(1, 2, 60, 64), normal(1, 2, 60, 64))
        qd = normal(1, 4, 60, 64)
        kd, vd = learned(qd, kd, vd, 0.125)
        if kd.recent is None:
            fail("the default's 60-token chunk over a 16-token window was not read as decode")
        checks.append(("prefill read as decode", K.dispatch_attention(qd, kd, vd, 0.125, "causal"),
                       K.turboquant_attention(qd, kd, vd, 0.125, "causal")))
        x = normal(3, 64).astype(mx.float32)
        rotation = keys.quantizer.groups[0].rotation
        checks.append(("rotate", K.dispatch_rotate(x, rotation, True), K.rotate_reference(x, rotation, True)))
        for name, got, want in checks:
            g, w = np.asarray(got.astype(mx.float32)), np.asarray(want.astype(mx.float32))
            if g.shape != w.shape or not np.allclose(g, w, atol=2e-2, rtol=2e-2):
                fail(f"{name}: kernel output differs from the reference")
    status = K.self_check_status()
    for (kernel, variant), reason in sorted(status.items(), key=str):
        print(f"self-check {kernel} {variant}: {'passed' if reason is None else 'FAILED: ' + reason}")
    ran = {kernel for kernel, _ in status}
    want = {"rotate", "encode", "dequantize", "decode_attention", "prefill_attention"}
    if ran != want:
        fail(f"self-checks ran for {sorted(ran)}, expected {sorted(want)}")
    if any(reason is not None for reason in status.values()):
        fail("a kernel failed its self-check")
    if "encode_dense" not in built:
        fail("encode_dense was never built")
    print(f"ok: {len(status)} kernel variants passed their self-checks under the emulator, "
          f"built from the installed sources ({', '.join(sorted(set(built)))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
