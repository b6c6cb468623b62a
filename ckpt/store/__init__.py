"""Where bytes live: storage URLs and TensorStore kvstores (file, gs://, s3://, memory), OCDBT,
the bridge from TensorStore futures to asyncio, deadlines on store calls, the byte limiter and
the meter of fetched bytes.

May import: ckpt.errors only.
"""
