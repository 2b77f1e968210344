"""Bytes: everything mconvert writes or reads at the level of files and bytes, below the format adapters.

`hashing` (the aligned hashing file writer), `safetensors` (one header codec, its reader and writers),
`torchsave` (the torch.save zip stream and offset-indexed reading of `.pt` files), `safeload` (the only way a
pickle is opened), `unpickler` (the restricted unpickler it runs every pickle through first), `crc` (the CRC-32 check of input zips), `casts` (`narrowed` and the finite checks),
`transpose` (the vectorised 2-D transposed copy), `buffers` (the buffer pool), `repickle` (torch.save of what safeload read: its stand-ins under their own names),
`paths` (containment of names read from inputs), `atomic` (atomic output directories and the integrity
manifest) and `tuning` (process-wide settings, applied by the CLI only).
"""
