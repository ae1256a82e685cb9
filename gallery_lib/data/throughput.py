"""How fast each image pipeline delivers training batches on its own, with no model: can the data keep up?"""

from __future__ import annotations

import time

import torch

from gallery_lib.data.device_decode import PIPELINES


def pipeline_throughput(data_dir, *, batch_size: int, image_size: int, device: str, num_workers: int,
                        pipelines=PIPELINES, batches: int = 20, warmup: int = 5) -> list[dict]:
    """Images per second of each image pipeline over ``batches`` batches after ``warmup`` (crop, flip and label
    smoothing only, as the ResNet recipe trains; on ``device``). A pipeline that fails gives its error instead."""
    from gallery_lib.data import RobustImageFolder, build_train_loader

    rows = []
    for pipeline in pipelines:
        try:
            loader = build_train_loader(RobustImageFolder(data_dir), batch_size=batch_size, image_size=image_size,
                                        device=device, num_workers=num_workers, color_jitter=0.0,
                                        label_smoothing=0.1, pipeline=pipeline)
            stream = iter(loader)
            for _ in range(warmup):  # the workers start and their first batches drain
                next(stream)
            _sync(device)
            start = time.perf_counter()
            for _ in range(batches):
                next(stream)
            _sync(device)
            rate = batches * batch_size / (time.perf_counter() - start)
            rows.append({"pipeline": pipeline, "device": device, "workers": num_workers, "img_per_s": rate,
                         "skipped": loader.skipped})
            del stream, loader
        except Exception as exc:  # noqa: BLE001 - one pipeline failing (no nvjpeg, say) keeps the others' rows
            rows.append({"pipeline": pipeline, "device": device, "error": f"{type(exc).__name__}: {exc}"[:300]})
    return rows


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
