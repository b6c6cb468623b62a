"""Hugging Face weights in and out: safetensors files read straight onto a target's shardings
(each process only the byte ranges its devices hold) and a saved step written as a Hub-ready
sharded set.

The data path: header.py (an untrusted header parsed within bounds) -> files.py (the files of a
file, directory or index JSON, read by byte range through TensorStore kvstores) -> names.py
(Hugging Face keys to target paths and back: ``[i]`` stacks, ``.T`` transposes) -> leaves.py
(tensors as lazy leaves: each process reads the rows its boxes need, once) -> load.py (matched
to the target and placed as a restore places them, read once over replicas on buckets) ->
export.py (a saved step streamed slice by slice into shards and the index JSON).

May import: the wings below it (errors, store, format, shards, multihost, commit, save,
restore); never tiers or cli (cli imports it).
"""
