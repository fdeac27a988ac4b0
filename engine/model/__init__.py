"""The M3 model for serving: config, layers, vision tower, checkpoint loading, tiny default.

What the engine runtime uses::

    from m3stack.engine.model.loader import load_model
    from m3stack.engine.attention.reference import ReferenceAttentionBackend   # CPU; engine.attention.gpu on CUDA

    model, config = load_model(path, device, dtype)      # config.json + safetensors (sharded or single file)
    spec = model.kv_cache_spec(dtype)                    # -> allocate_kv_cache(spec, num_pages, device)
    embeds = model.encode_vision(patches, grid_thw, "image")       # uint8 or normalized patches -> [N/4, hidden]
    backend.begin_step(metadata)
    hidden = model.forward(input_ids, positions, backend, mm_positions, mm_embeds)   # flat [T] batch
    logits = model.compute_logits(hidden[logits_indices])           # float32 [n, vocab]

Modules: ``config`` (config.json -> ``M3Config``), ``weights`` (checkpoint tensor names -> parameters),
``loader``, ``model`` (``M3ForServing``), ``attention`` / ``moe`` / ``mlp`` / ``norm`` / ``rope`` (decoder parts;
``fused``: their elementwise ops as one Triton kernel each, used on CUDA tensors),
``vision`` + ``projector``, ``tiny`` + ``tiny_tokenizer`` (the random-weight default model), ``cli``
(``m3stack model init-tiny | inspect``).
"""
