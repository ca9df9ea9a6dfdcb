"""A vLLM worker (P1) as a Ray actor, the way vLLM's Ray executor places one per rank:
shmstore's receiver cache, vLLM's msgpack decoder, features as vLLM builds them."""

from __future__ import annotations

from typing import Any

import ray


@ray.remote(num_cpus=0)
class VllmWorker:
    def __init__(self, config: Any, env: dict[str, str]) -> None:
        from harness import setup_process

        setup_process(env)
        from vllm.multimodal.inputs import MultiModalKwargsItem
        from vllm.v1.serial_utils import MsgpackDecoder

        from shmstore.vllm import ShmstoreReceiverCache

        self.receiver = ShmstoreReceiverCache(config)
        self.decoder = MsgpackDecoder(MultiModalKwargsItem)

    def info(self) -> dict[str, Any]:
        import shmstore

        nodes = self.receiver.nodes
        try:
            self.receiver.store.put("write-probe", b"x")
            read_only = False
        except shmstore.ReadOnly:
            read_only = True
        return {"bridged": nodes is not None, "store": self.receiver.store.path, "read_only": read_only}

    def request(self, entries: list[tuple[str, list[bytes]]]) -> tuple[str, list[Any]]:
        """One request's items (hash, encoded item): ("ok", digests) or ("miss", hashes)."""
        from harness import digest
        from vllm.multimodal.cache.base import MultiModalCacheMissError
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

        features = [
            MultiModalFeatureSpec(
                data=self.decoder.decode(bufs),
                modality="image",
                identifier=h,
                mm_position=PlaceholderRange(offset=0, length=1),
                mm_hash=h,
            )
            for h, bufs in entries
        ]
        try:
            self.receiver.get_and_update_features(features)
        except MultiModalCacheMissError as e:
            return "miss", sorted(e.mm_hashes)
        return "ok", [digest(f.data) for f in features]
