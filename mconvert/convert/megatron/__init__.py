"""The Megatron-LM side: the rank-file source and writer (`source`), torch_dist (`torch_dist`, `torch_dist_writer`),
Adam states (`optimizer`, `dp_buckets`), rank directory names (`layout`), a checkpoint's frame (`checkpoint`) and
Megatron-Bridge's files (`bridge`)."""
