"""The M3Deployment's status schema: what the operator (and its autoscaler) write back, read by ``kubectl`` and the
scale subresource (``crd``)."""

from m3stack.operator.schema import Schema, array, integer, number, obj, string


def _component_status(component: str) -> Schema:
    return obj(
        f"Observed {component} pods.",
        {
            "replicas": integer("Pods that exist.", minimum=0),
            "readyReplicas": integer("Pods that are Ready.", minimum=0),
            "updatedReplicas": integer("Pods of the current template.", minimum=0),
            "availableReplicas": integer("Pods Ready for at least minReadySeconds.", minimum=0),
            "selector": string("Label selector of the pods.", max_length=1024),
        },
    )


CONDITION_SCHEMA = obj(
    "A metav1.Condition.",
    {
        "type": string("Condition type.", min_length=1, max_length=316),
        "status": string("True, False or Unknown.", enum=["True", "False", "Unknown"]),
        "reason": string("Machine-readable CamelCase reason.", max_length=1024),
        "message": string("Human-readable details.", max_length=32768),
        "lastTransitionTime": {
            "type": "string",
            "format": "date-time",
            "description": "When the status last changed.",
        },
        "observedGeneration": integer("Generation the condition was computed for.", minimum=0, fmt="int64"),
    },
    required=["type", "status"],
)

STATUS_SCHEMA = obj(
    "Observed state, written by the operator.",
    {
        "observedGeneration": integer("Generation of the spec the children were rendered from.", fmt="int64"),
        "phase": string(
            "One-word summary, the first that holds: Suspended; Degraded (a persistent problem, even while serving); "
            "Ready (serving, as the Ready condition: replicas may still be loading); Progressing (pods exist); "
            "Pending.",
            enum=["Pending", "Progressing", "Ready", "Degraded", "Suspended"],
        ),
        "url": string("Base URL of the OpenAI-compatible API.", max_length=2048),
        "conditions": array(
            "Ready (it serves: an engine and a gateway are ready; stays True while more replicas load, reason "
            "PartiallyReady), EnginesReady and GatewayReady (every desired replica ready), Progressing (a rollout "
            "or scale in progress), Degraded (a problem waiting will not fix), Fits (the model fits the engine's "
            "GPUs), AutoscalingActive.",
            CONDITION_SCHEMA,
            max_items=16,
            list_type="map",
            map_keys=["type"],
        ),
        "gateway": _component_status("gateway"),
        "engine": _component_status("engine"),
        "autoscaling": obj(
            "State of the engine autoscaler (written by the built-in autoscaler, field manager m3stack-autoscaler).",
            {
                "mode": string("Active mode.", enum=["Builtin", "KEDA", "HPA", "None"]),
                "desiredReplicas": integer("Last decision.", minimum=0),
                "observedConcurrency": number(
                    "In-flight engine requests over all gateways, averaged over the stable window."
                ),
                "panicConcurrency": number("The same, averaged over the panic window."),
                "state": string("Stable or Panic.", enum=["Stable", "Panic"]),
                "reason": string(
                    "Why the last decision is what it is (Steady, Scaled, ScaleDownDelayed, MaxReplicasReached, "
                    "InsufficientCapacity, PodsPending, NoMetrics).",
                    max_length=64,
                ),
                "gatewayTargets": integer("Gateways found to read in-flight counts from.", minimum=0),
                "gatewaysScraped": integer("Gateways that answered the last read.", minimum=0),
                "lastScaleTime": {"type": "string", "format": "date-time", "description": "Last change of replicas."},
                "recentDecisions": array(
                    "The last changes of the engine count, oldest first.",
                    obj(
                        "One change of spec.engine.replicas.",
                        {
                            "time": {"type": "string", "format": "date-time", "description": "When."},
                            "fromReplicas": integer("Engines before.", minimum=0),
                            "toReplicas": integer("Engines after.", minimum=0),
                            "reason": string("The decision's reason.", max_length=64),
                            "state": string("Stable or Panic.", enum=["Stable", "Panic"]),
                            "observedConcurrency": number("Stable-window concurrency when decided."),
                        },
                    ),
                    max_items=5,
                ),
            },
        ),
    },
)
