"""The processes a run is made of: the launcher, joining the process group and sharding with FSDP2, stop
signals, agreement between ranks, non-finite checks, and the storage dtypes."""
