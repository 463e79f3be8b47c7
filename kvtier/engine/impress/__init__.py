"""IMPRESS, the importance-only restore (lossy, opt-in): its policy, the choosing prefill and the
restore job the link runs. One room; the restore executors and the scheduler never import it."""
