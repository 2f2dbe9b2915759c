"""What a trainer that streams from data hosts makes of them: the classes of a sharded channel, agreed by
every host's Describe (``shard_classes``), and the summary's account of them: what each rank
saw (``rank_service_stats``, gathered across ranks by the loop) merged into the job's figures
(``service_summary``): hosts lost and why, batches per host, and which data-host epochs reached
training exactly once (training/data_service/epochs.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from training.data_service.dataset import ChannelError
from training.data_service.epochs import epoch_report, merge


def rank_service_stats(service: Any) -> dict[str, Any]:
    """This rank's view of its streams (a DataServiceDataset's stats), JSON-able for the gather."""
    stats = service.stats
    return {
        "lost_data_hosts": stats.unavailable_hosts,
        "lost_data_host_reasons": stats.lost_reasons,
        "batches_per_data_host": {address: state.batches for address, state in stats.hosts.items()},
        "data_host_names": {address: state.host for address, state in stats.hosts.items()},
        "skipped_samples": stats.skipped_samples,
        "epochs": stats.ledger.as_dict(),
    }


def service_summary(addresses: Sequence[str], ranks: Sequence[Mapping[str, Any]], epoch_samples: Mapping[str, int], *,
                    sharded: bool, epochs: bool = True, earlier: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Every rank's stream stats as the job's. ``epochs``: False when the trainers cycle a few cached
    batches (those are not epochs). ``earlier``: the epoch receipts of the run's earlier jobs (a resumed
    run's checkpoint), counted with this job's. Pure."""
    return {
        "data_hosts": list(addresses),
        # Their names (algo-1), which the epochs of a sharded channel go by: the addresses are this job's.
        "data_host_names": [_host_names(ranks).get(address, address) for address in addresses],
        # A host any rank lost is lost to the job; what each host served, summed over every rank.
        "lost_data_hosts": sorted({host for rank in ranks for host in rank["lost_data_hosts"]}),
        # Why: the first rank's word for each (a hung host's stall, a MalformedBatchError, a refusal).
        "lost_data_host_reasons": {host: reason for rank in reversed(ranks) for host, reason in rank["lost_data_host_reasons"].items()},
        "batches_per_data_host": {address: sum(rank["batches_per_data_host"].get(address, 0) for rank in ranks) for address in addresses},
        "epochs": epoch_report(merge([earlier or {}, *(rank["epochs"] for rank in ranks)]), epoch_samples, per_host=sharded) if epochs else None,
    }


def _host_names(ranks: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Each data host's name by address, as any rank learnt it from the host's Describe. Pure."""
    return {address: name for rank in ranks for address, name in rank.get("data_host_names", {}).items() if name != address}


def shard_classes(infos: list[Any]) -> list[str]:
    """The classes of a sharded channel, from every data host's Describe. Tar shards label by class index:
    the model needs as many classes as the highest index of any host's shards. An ImageFolder share
    labels by its own class folders: all hosts must hold the same ones, or a label would mean different
    classes from different hosts (S3 deals a sharded channel's objects without regard to folders, so a
    class with fewer files than hosts, or keys dealt in ranges, leaves a host without some class)."""
    if all(info.labels_are_indices for info in infos):
        return list(max((info.classes for info in infos), key=len))
    classes = {info.host: tuple(info.classes) for info in infos}
    if len(set(classes.values())) > 1:
        every = sorted({name for names in classes.values() for name in names})
        missing = {host: sorted(set(every) - set(names)) for host, names in classes.items() if set(names) != set(every)}
        raise ChannelError(f"the data hosts' shards of a sharded channel hold different class folders (missing: {missing}), "
                           "so their labels would disagree: use a replicated channel, or tar shards (their labels are class indices)")
    return list(infos[0].classes)
