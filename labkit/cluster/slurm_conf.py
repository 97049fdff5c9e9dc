"""The configuration of a Slurm run on the emulated cluster (pure text: writes nothing).

:func:`labkit.cluster.slurm.slurm_cluster` writes these files into the run's checked folder."""

from __future__ import annotations

from pathlib import Path

from labkit.cluster.netns import NetnsPlan

__all__ = ["HEAD_ADDR", "hosts_file", "node_names", "slurm_conf"]

HEAD_ADDR = "10.77.255.254"  # the controller's address on the run's bridge (nodes: 10.77.0.N)


def node_names(nodes: int) -> list[str]:
    return [f"node{i}" for i in range(nodes)]


def hosts_file(plan: NetnsPlan) -> str:
    """``/etc/hosts`` of every namespace of the run: the head and each node by name."""
    lines = ["127.0.0.1 localhost", f"{HEAD_ADDR} head"]
    lines += [f"{plan.address(i)} {name}" for i, name in enumerate(node_names(plan.nodes))]
    return "\n".join(lines) + "\n"


def slurm_conf(plan: NetnsPlan, run_dir: Path, cpus: int) -> str:
    """The run's slurm.conf: munge auth through the run's socket, no cgroups, no accounting,
    every path in ``run_dir`` (``%n``: the node's name)."""
    d = run_dir
    nodes = " ".join(
        f"NodeName={name} NodeAddr={plan.address(i)} CPUs={cpus} State=UNKNOWN\n"
        for i, name in enumerate(node_names(plan.nodes))
    )
    return f"""ClusterName=labkit
SlurmctldHost=head({HEAD_ADDR})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge.socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/ctld
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmctldTimeout=30
MailProg=/bin/true
SlurmdTimeout=30
KillWait=2
MinJobAge=300
PlugStackConfig={d}/plugstack.conf
{nodes}PartitionName=lab Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
