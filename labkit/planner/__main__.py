"""``python -m labkit.planner``: the planner against every published and measured run it is
checked against (Table 1, Korthikanti's Table 5, BLOOM, MT-NLG, LLaMA, this project's H200)."""

from labkit.planner.table1 import main

main()
