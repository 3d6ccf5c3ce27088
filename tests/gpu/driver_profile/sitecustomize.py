"""cProfile of the RL driver (`python -m runtime PLAN`) when MOLT_PROFILE_DRIVER names a directory: bench_loop's
`+profile` modes put this directory first on PYTHONPATH. Every other process that imports it (Ray's own, the actors')
returns at once. At the driver's exit it writes MOLT_PROFILE_DRIVER/driver.prof (pstats) and driver_profile.txt: the
loop's callees (`train_step`, `train`), which name where a step's time outside its timed phases goes (issue 29), and
the garbage collector's pauses."""

import os
import sys

_out = os.environ.get("MOLT_PROFILE_DRIVER")
_argv = getattr(sys, "orig_argv", [])
if _out and "-m" in _argv and _argv[_argv.index("-m") + 1:][:1] == ["runtime"]:
    import atexit
    import cProfile
    import gc
    import io
    import pstats
    import time

    _profile = cProfile.Profile()
    _gc = {"started": 0.0, "seconds": [0.0, 0.0, 0.0], "count": [0, 0, 0], "longest": 0.0}

    def _time_gc(phase: str, info: dict) -> None:  # the collector's pauses, which cProfile charges to any caller
        if phase == "start":
            _gc["started"] = time.perf_counter()
            return
        took = time.perf_counter() - _gc["started"]
        _gc["seconds"][info["generation"]] += took
        _gc["count"][info["generation"]] += 1
        _gc["longest"] = max(_gc["longest"], took)

    gc.callbacks.append(_time_gc)

    def _dump() -> None:
        _profile.disable()
        os.makedirs(_out, exist_ok=True)
        _profile.dump_stats(os.path.join(_out, "driver.prof"))
        text = io.StringIO()
        text.write(f"gc: collections per generation {_gc['count']}, seconds {[round(x, 3) for x in _gc['seconds']]}, "
                   f"longest {_gc['longest']:.3f} s\n")
        stats = pstats.Stats(_profile, stream=text).sort_stats("cumulative")
        stats.print_callees(r"loop.py:\d+\((train|train_step)\)")
        stats.print_callees(r"metrics.py:\d+\(log\)")
        stats.print_stats(80)
        with open(os.path.join(_out, "driver_profile.txt"), "w") as f:
            f.write(text.getvalue())

    atexit.register(_dump)
    _profile.enable()
