"""The account: decision records written (``log``) and read back (the postmortem, the
plot, ``gpupool top``, progress bars). Readers take a log or a published snapshot, never
a pool's live state."""
