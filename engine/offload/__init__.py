"""CPU KV offload: contexts whose KV exceeds the device, served with a GPU-resident k-index.

Block (page) ids come in two tiers (``layout``): device ids hold a block's whole KV on the device;
host ids keep its MSA-layer K/V in pinned host memory while its k-index and dense-layer K/V stay on
the device.  ``tiered_manager`` moves blocks from the first tier to the second under pressure
(shared prefixes stay), ``hot_buffer`` gives each request with host blocks a few device pages per
MSA layer, ``resolver`` maps each decode step's top-k selection onto them (hits) and lists the
host -> device copies (misses) that ``page_copy`` performs on a side stream, ``prefill_staging``
serves prefill chunks over host blocks, and ``metrics`` counts what happened.
``DeviceOffload`` (``device``) is what the runner and the attention backends talk to.
"""
