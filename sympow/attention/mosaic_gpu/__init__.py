"""The Hopper tier (`impl='mosaic_gpu'`): the attention kernels in Mosaic GPU (wgmma, TMA,
warp specialization) for sm90 GPUs, on top of the portable tier (docs/design.md §5.4)."""
