"""One training run: the loop, its run directory, control between ranks, watchdog and profiling."""
