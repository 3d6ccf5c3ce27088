"""Where the run's chatty logs go: vLLM's INFO and WARNING lines into files under `<logging.out_dir>/logs/`, its errors
still on the terminal (stderr), so that a run shows one line per step and not thousands of engine lines (vLLM warns
about every CPU fallback and unsupported option; the engine log keeps them for whoever needs them).

vLLM reads a `logging.config.dictConfig` JSON file named by `VLLM_LOGGING_CONFIG_PATH` in every process it starts
(the engine core is a subprocess), so one environment variable on the engine actor routes all of them.
"""

from __future__ import annotations

import json
from pathlib import Path

_FORMAT = "%(levelname)s %(asctime)s %(process)d %(name)s: %(message)s"


def vllm_logging_env(log_dir: Path, name: str) -> dict[str, str]:
    """Write `<log_dir>/<name>.logging.json` (INFO and up to `<log_dir>/<name>.log`, ERROR and up to stderr too) and
    return the environment that makes vLLM use it."""
    log_dir = log_dir.resolve()  # engine actors may run in another working directory
    log_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": _FORMAT, "datefmt": "%m-%d %H:%M:%S"}},
        "handlers": {
            "file": {"class": "logging.FileHandler", "filename": str(log_dir / f"{name}.log"), "level": "INFO",
                     "formatter": "plain"},
            "terminal": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "level": "ERROR",
                         "formatter": "plain"},
        },
        "loggers": {"vllm": {"handlers": ["file", "terminal"], "level": "INFO", "propagate": False}},
    }
    path = log_dir / f"{name}.logging.json"
    path.write_text(json.dumps(config, indent=1))
    return {"VLLM_CONFIGURE_LOGGING": "1", "VLLM_LOGGING_CONFIG_PATH": str(path)}
