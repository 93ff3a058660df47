"""The processes of a tensor-parallel group other than its rank 0 (the engine worker)."""
