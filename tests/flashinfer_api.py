"""The signatures of the FlashInfer calls mmkv makes, as recorded from flashinfer-python 0.7.4.

CI does not install FlashInfer (about 870 MB unpacked, with CUDA-only dependencies), so tests bind
mmkv's calls against this record (``flashinfer_api.json``); ``test_flashinfer_api.py`` checks the
record against the package wherever it is installed. ``BatchDecodeWithPagedKVCacheWrapper.plan``
takes its options as ``**kwargs`` and hands them to ``_plan_impl``, whose keyword-only parameters
are the real check; both are recorded.

Re-record (with flashinfer-python installed, ``--no-deps`` plus apache-tvm-ffi, requests and
nvidia-ml-py is enough on a CPU): ``python tests/flashinfer_api.py --write``.
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

RECORD = Path(__file__).with_name("flashinfer_api.json")
TARGETS = (
    "BatchPrefillWithPagedKVCacheWrapper.__init__", "BatchPrefillWithPagedKVCacheWrapper.plan",
    "BatchPrefillWithPagedKVCacheWrapper.run", "BatchDecodeWithPagedKVCacheWrapper.__init__",
    "BatchDecodeWithPagedKVCacheWrapper.plan", "BatchDecodeWithPagedKVCacheWrapper._plan_impl",
    "BatchDecodeWithPagedKVCacheWrapper.run", "append_paged_kv_cache", "merge_state",
)
IMPLEMENTED_BY = {"BatchDecodeWithPagedKVCacheWrapper.plan": "BatchDecodeWithPagedKVCacheWrapper._plan_impl"}


def describe(fn) -> list[list]:
    """A signature as JSON: per parameter its name, kind and default (``repr``, or None)."""
    return [[p.name, p.kind.name, None if p.default is p.empty else repr(p.default)]
            for p in inspect.signature(fn).parameters.values()]


def live() -> dict[str, list[list]]:
    """The signatures of the installed package."""
    import flashinfer

    out = {}
    for target in TARGETS:
        obj = flashinfer
        for part in target.split("."):
            obj = getattr(obj, part)
        out[target] = describe(obj)
    return out


def recorded() -> dict:
    return json.loads(RECORD.read_text())


def signature(target: str) -> inspect.Signature:
    """The recorded signature of ``target`` (defaults stand in as their ``repr`` strings)."""
    params = [inspect.Parameter(name, getattr(inspect.Parameter, kind),
                                default=inspect.Parameter.empty if default is None else default)
              for name, kind, default in recorded()["signatures"][target]]
    return inspect.Signature(params)


def bind(target: str, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """Bind a call of ``target`` (a method gets ``None`` for ``self``) as FlashInfer would;
    ``TypeError`` when the arguments do not fit. A method that forwards ``**kwargs`` is bound
    against the one it forwards to as well."""
    method = "." in target
    full = (None, *args) if method else args
    bound = signature(target).bind(*full, **kwargs)
    if target in IMPLEMENTED_BY:
        bound = signature(IMPLEMENTED_BY[target]).bind(*full, **kwargs)
    return bound


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/flashinfer_api.py --write")
    import flashinfer

    entries = ",\n".join(f"  {json.dumps(t)}: [\n" + ",\n".join(f"   {json.dumps(p)}" for p in params) + "]"
                         for t, params in live().items())
    RECORD.write_text(f'{{"version": {json.dumps(flashinfer.__version__)}, "signatures": {{\n{entries}}}}}\n')
    print(f"recorded {len(TARGETS)} signatures of flashinfer {flashinfer.__version__} in {RECORD}")
