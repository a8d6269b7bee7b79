"""The on-disk format: frame chunks and shards, their codec, step blocks, the manifest.

Everything here knows files and bytes; nothing here knows episodes, sampling policy or torch.

    frame_store   batched write(slots, frames) / read(slots) over a sharded zarr v3 array
    shards        shard files: append, index, memory-mapped reads
    codec         the chunk codec (lz4 / zstd through c-blosc) and its checks
    commit        generations: copy-on-write step blocks, the writer lock, readers
    manifest      the versioned manifest naming one generation; format checks
    layout        which files a store may hold, checked before any is read
    safe_io       bounded reads, atomic writes, fsync of files and folders
    objects       object storage: keys and bytes (a directory, or S3 through obstore)
    bucket        a store in object storage: its keys, its manifest as push and pull read it
    lease         the one writer that may push into a prefix (lease.json)
    push          a directory's committed generation into a bucket
    pull          a bucket's newest generation into a directory
    remote_frames frame chunks fetched on demand from a bucket into a bounded cache
    remote_open   a bucket store opened for reads: small files pulled, the manifest followed
"""
