"""Feature data loader, per-algorithm train strategies, TrainerCore, ack ledger, export."""
