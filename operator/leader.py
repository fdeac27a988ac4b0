"""Leader election on a ``coordination.k8s.io`` Lease: several operator replicas, exactly one reconciling.

Why our own, rather than the alternatives:

- kopf peering is not leader election: operators of equal priority pause each other, a standby resumes
  only when the leader's peering record ages out (60 s by default), and it needs cluster-scoped
  peering CRDs and RBAC for them.
- ``kubernetes.leaderelection`` (the Python client's port of client-go's) runs in threads with sleep
  loops, reads the client's global default configuration instead of the operator's ApiClient, cannot
  be stopped nor release its lease on shutdown (every rolling update would then wait out a whole
  lease), and logs at INFO on every retry.

The semantics are client-go's (``k8s.io/client-go/tools/leaderelection``): the holder renews
``spec.renewTime`` every retry period; a candidate takes the Lease once it has seen the same record
unchanged for ``leaseDurationSeconds`` on its own clock (clocks need not agree); every write carries
the ``resourceVersion`` it read, so two candidates never both win; a leader that cannot renew within
the renew deadline stops leading (before anyone else may take over); a leader that stops cleanly
empties the Lease, so a standby takes over at its next retry.

Defaults: lease 8 s, renew deadline 6 s, retry 2 s.  A standby sees the dead leader's last renewal
at most one retry after it, waits out the lease from there, and tries again within one more retry: it
takes over at most 2 + 8 + 2 = 12 s after a leader died without releasing (killed, node lost), and
within one retry period after a clean stop.
"""

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from m3stack.operator.apply import Rule

logger = logging.getLogger(__name__)

DEFAULT_LEASE_NAME = "m3stack-operator"
# What leader election needs, in the operator's own namespace only (a Role, not the ClusterRole).
LEADER_ELECTION_RULES = (Rule("coordination.k8s.io", ("leases",), ("create", "get", "update")),)


@dataclass(frozen=True)
class ElectionSettings:
    namespace: str
    identity: str  # unique per replica: the pod's name
    name: str = DEFAULT_LEASE_NAME
    lease_duration_s: float = 8.0
    renew_deadline_s: float = 6.0
    retry_period_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.retry_period_s < self.renew_deadline_s < self.lease_duration_s:
            raise ValueError("leader election needs retry period < renew deadline < lease duration")


def _describe(error: ApiException) -> str:
    return f"{error.status} {error.reason}"


class LeadershipLostError(Exception):
    """The leader could not renew its Lease within the renew deadline."""


class LeaderElector:
    def __init__(
        self,
        api: k8s.CoordinationV1Api,
        settings: ElectionSettings,
        on_change: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.settings = settings
        self.is_leader = False
        self._on_change = on_change
        self._clock = clock
        self._observed_version: str | None = None  # the Lease record last seen, and when (our clock)
        self._observed_at = 0.0

    # --- asyncio side ---------------------------------------------------------------------------

    async def acquire(self) -> None:
        """Returns once this replica leads."""
        while not await asyncio.to_thread(self.try_acquire_or_renew):
            await asyncio.sleep(self.settings.retry_period_s)
        self._set_leader(True)

    async def keep(self) -> None:
        """Renews until it cannot within the renew deadline: then raises ``LeadershipLostError``."""
        last_renewal = self._clock()
        while True:
            await asyncio.sleep(self.settings.retry_period_s)
            if await asyncio.to_thread(self.try_acquire_or_renew):
                last_renewal = self._clock()
            elif self._clock() - last_renewal > self.settings.renew_deadline_s:
                self._set_leader(False)
                raise LeadershipLostError(
                    f"could not renew Lease {self.settings.namespace}/{self.settings.name} "
                    f"within {self.settings.renew_deadline_s:g}s"
                )

    async def release(self) -> None:
        """Hands the Lease back (a clean stop): a standby takes it at its next retry."""
        if self.is_leader:
            await asyncio.to_thread(self._release)
            self._set_leader(False)

    def _set_leader(self, leading: bool) -> None:
        if leading != self.is_leader:
            self.is_leader = leading
            if self._on_change is not None:
                self._on_change(leading)

    # --- one attempt (a thread) -----------------------------------------------------------------

    def try_acquire_or_renew(self) -> bool:
        """One round of reads and writes: True when this replica holds the Lease afterwards."""
        settings = self.settings
        try:
            lease = self.api.read_namespaced_lease(settings.name, settings.namespace, **self._timeout())
        except ApiException as error:
            if error.status == 404:
                return self._create()
            logger.warning("reading Lease %s/%s failed: %s", settings.namespace, settings.name, _describe(error))
            return False
        except Exception as error:  # the API server unreachable: try again next period
            logger.warning("reading Lease %s/%s failed: %s", settings.namespace, settings.name, error)
            return False
        now = self._clock()
        if lease.metadata.resource_version != self._observed_version:
            self._observed_version, self._observed_at = lease.metadata.resource_version, now
        spec = lease.spec or k8s.V1LeaseSpec()
        holder = spec.holder_identity or ""
        duration = spec.lease_duration_seconds or settings.lease_duration_s
        if holder and holder != settings.identity and now - self._observed_at < duration:
            return False  # someone else holds it and has renewed within the lease
        stamp = datetime.now(UTC)
        taking_over = holder != settings.identity
        lease.spec = k8s.V1LeaseSpec(
            holder_identity=settings.identity,
            lease_duration_seconds=round(settings.lease_duration_s),
            acquire_time=stamp if taking_over else spec.acquire_time,
            renew_time=stamp,
            lease_transitions=(spec.lease_transitions or 0) + (1 if taking_over and holder else 0),
        )
        return self._write(lease, taking_over, previous=holder)

    def _create(self) -> bool:
        settings = self.settings
        stamp = datetime.now(UTC)
        lease = k8s.V1Lease(
            metadata=k8s.V1ObjectMeta(name=settings.name, namespace=settings.namespace),
            spec=k8s.V1LeaseSpec(
                holder_identity=settings.identity,
                lease_duration_seconds=round(settings.lease_duration_s),
                acquire_time=stamp,
                renew_time=stamp,
                lease_transitions=0,
            ),
        )
        try:
            created = self.api.create_namespaced_lease(settings.namespace, lease, **self._timeout())
        except ApiException as error:
            if error.status != 409:  # 409: another replica created it first
                logger.warning("creating Lease %s/%s failed: %s", settings.namespace, settings.name, _describe(error))
            return False
        except Exception as error:
            logger.warning("creating Lease %s/%s failed: %s", settings.namespace, settings.name, error)
            return False
        self._observed_version, self._observed_at = created.metadata.resource_version, self._clock()
        logger.info("%s leads: created Lease %s/%s", settings.identity, settings.namespace, settings.name)
        return True

    def _write(self, lease: k8s.V1Lease, taking_over: bool, previous: str) -> bool:
        settings = self.settings
        try:
            updated = self.api.replace_namespaced_lease(settings.name, settings.namespace, lease, **self._timeout())
        except ApiException as error:
            if error.status != 409:  # 409: the record changed since we read it (someone else renewed or took it)
                logger.warning("writing Lease %s/%s failed: %s", settings.namespace, settings.name, _describe(error))
            return False
        except Exception as error:
            logger.warning("writing Lease %s/%s failed: %s", settings.namespace, settings.name, error)
            return False
        self._observed_version, self._observed_at = updated.metadata.resource_version, self._clock()
        if taking_over:
            logger.info("%s leads: took Lease %s/%s from %s", settings.identity, settings.namespace, settings.name,
                        previous or "nobody")  # fmt: skip
        return True

    def _release(self) -> None:
        settings = self.settings
        try:
            lease = self.api.read_namespaced_lease(settings.name, settings.namespace, **self._timeout())
            if (lease.spec.holder_identity or "") != settings.identity:
                return
            stamp = datetime.now(UTC)
            # client-go's release: no holder, a one-second lease, so nobody waits on the old record.
            lease.spec = k8s.V1LeaseSpec(
                holder_identity=None,
                lease_duration_seconds=1,
                acquire_time=stamp,
                renew_time=stamp,
                lease_transitions=lease.spec.lease_transitions,
            )
            self.api.replace_namespaced_lease(settings.name, settings.namespace, lease, **self._timeout())
            logger.info("%s released Lease %s/%s", settings.identity, settings.namespace, settings.name)
        except Exception as error:  # the standby then waits out the lease instead
            logger.warning("releasing Lease %s/%s failed: %s", settings.namespace, settings.name, error)

    def _timeout(self) -> dict[str, float]:
        # One call never outlasts a retry period, so a hung API server cannot stretch the renew deadline.
        return {"_request_timeout": self.settings.retry_period_s}
