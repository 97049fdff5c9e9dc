"""``python -m labkit.planner``: the planner against every published and measured run it is
checked against (Table 1, Korthikanti's Table 5, BLOOM, MT-NLG, LLaMA, this project's H200),
then its accuracy at the configurations really measured (``accuracy.py``: Table 1 at each
run's settings, Korthikanti at Table 3's, Figures 12-16, ZeRO-3 / FSDP at scale), then context
and expert parallelism demonstrated (``long_moe.py``: printed, not compared)."""

from labkit.planner import accuracy, long_moe
from labkit.planner.table1 import main

main()
print()
accuracy.main()
print()
long_moe.main()
