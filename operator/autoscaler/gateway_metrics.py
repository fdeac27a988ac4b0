"""The gateway metrics every engine autoscaler reads (defined in ``gateway/metrics.py``; a test checks
these names against a real gateway's page): the built-in one scrapes them, KEDA and HPA get them
through Prometheus."""

# Engine requests one gateway has open on each engine right now (gauge, label ``engine``).
INFLIGHT = "m3stack_gateway_engine_inflight_requests"
# HTTP API requests by endpoint and status (counter, labels ``endpoint``, ``status``).
REQUESTS = "m3stack_gateway_requests_total"
# The status of a request no engine could take: demand while a deployment has no ready engine.
REFUSED_STATUS = "503"
