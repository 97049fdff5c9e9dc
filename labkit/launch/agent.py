"""The agent: a thin shell around torch's ``elastic_launch`` (the engine behind torchrun), run
as a subprocess of the caller so the elastic agent's signal handlers and environment changes
never touch a notebook kernel. The caller starts it with ``launcher._AGENT_BOOTSTRAP``, which
first imports torch and forks the forkserver the ranks fork from (``zygote.py``), then calls
:func:`_agent_main`.
"""

from __future__ import annotations

import os
from pathlib import Path

import cloudpickle

from labkit.launch.config import _JOB_FILE, LaunchConfig
from labkit.launch.rank import _set_pdeathsig, _worker, _write_json_atomic
from labkit.launch.runs import check_run_dir
from labkit.safe_files import write_private


def _agent_main(run_dir: str, parent_pid: int) -> int:
    _set_pdeathsig()
    if os.getppid() != parent_pid:  # the launcher died before prctl took effect
        return 1
    import logging

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig as ElasticConfig
    from torch.distributed.launcher.api import elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    run = Path(run_dir)
    check_run_dir(run)  # never unpickle from a folder someone else can write (runs.py)
    with open(run / _JOB_FILE, "rb") as f:
        cfg: LaunchConfig = cloudpickle.load(f)["config"]
    options: dict = dict(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.world_size,
        run_id=run.name,
        rdzv_backend="c10d",
        rdzv_endpoint=f"{cfg.host}:0",  # port 0: the OS picks a free port, no collisions
        rdzv_configs={"timeout": 60},
        local_addr=cfg.host,
        max_restarts=cfg.max_restarts,
        monitor_interval=0.05,
        start_method=str(cfg.start_method),
        log_line_prefix_template="[rank${rank}]: ",
        logs_specs=DefaultLogsSpecs(log_dir=str(run / "logs"), redirects=Std.ALL, tee=Std.ALL),
        shutdown_timeout=2,
    )
    # shutdown_timeout arrived in torch 2.13's LaunchConfig; an older torch (a GPU image may
    # ship one) waits its default instead.
    known = set(getattr(ElasticConfig, "__dataclass_fields__", options))
    config = ElasticConfig(**{k: v for k, v in options.items() if k in known})
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        elastic_launch(config, _worker)(run_dir)
    except ChildFailedError as exc:
        died = [
            {
                "rank": rank,
                "exitcode": f.exitcode,
                "signal": f.signal_name() if f.exitcode < 0 else "",
            }
            for rank, f in sorted(exc.failures.items())
        ]
        _write_json_atomic(run / "agent_failures.json", {"failures": died})
        return 1
    except Exception as exc:  # noqa: BLE001 - the launcher reads error.N.json for details
        write_private(run / "agent_error.txt", f"{type(exc).__name__}: {exc}")
        return 1
    return 0
