"""``python -m labkit.planner``: the planner against every published and measured run it is
checked against (Table 1, Korthikanti's Table 5, BLOOM, MT-NLG, LLaMA, this project's H200),
then context and expert parallelism demonstrated (``long_moe.py``: printed, not compared)."""

from labkit.planner import long_moe
from labkit.planner.table1 import main

main()
print()
long_moe.main()
