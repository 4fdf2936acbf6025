"""The memory backend's second tier: values kept in segment files, found again after a restart.

tier.py is the facade the memory tier holds (DiskTier); ports.py what the disk tier needs of the
memory tier (MemorySide) and nothing more; index.py a namespace's records on disk; writer.py the
write-behind thread; reads.py reading records back; rebuild.py the index from the files at start-up;
segments.py the segment files and their LRU; records.py and layout.py the formats on disk. Nothing
here imports the memory tier's modules: the arrow runs from memory to disk only.
"""
