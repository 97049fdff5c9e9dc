"""``python -m labkit.cluster --nodes 2 --world-size 4 --bandwidth 20e6 --mode auto``: probe."""

from labkit.cluster.probe import main

main()
