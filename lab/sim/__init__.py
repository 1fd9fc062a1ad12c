"""The fleet simulator (`sled lab simulate`): sled's own server core and device sessions on a
virtual clock, the GPU replaced by a step-cost profile, so fleets far larger than this machine
could emulate in real time are sized in seconds."""
