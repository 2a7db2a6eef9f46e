"""`radixserve simulate` / `calibrate`: the real Scheduler driven by a cost-model executor."""
