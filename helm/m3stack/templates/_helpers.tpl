{{/* Full name of the release's objects: the release name, plus the chart name unless it is in it. */}}
{{- define "m3stack.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "m3stack.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "m3stack.labels" -}}
{{ include "m3stack.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: m3stack
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "m3stack.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "m3stack.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "m3stack.componentImage" -}}
{{- $images := .root.Values.defaultImages -}}
{{- $tag := default .root.Chart.AppVersion $images.tag -}}
{{- default (printf "%s/%s:%s" $images.repository .component $tag) (index $images .component) -}}
{{- end -}}

{{/* Rules on the namespaced resources the operator serves and creates (see operator/apply.py REQUIRED_RULES). */}}
{{- define "m3stack.namespacedRules" -}}
- apiGroups: [m3stack.io]
  resources: [m3deployments]
  verbs: [get, list, patch, watch]
- apiGroups: [m3stack.io]
  resources: [m3deployments/status]
  verbs: [get, patch]
- apiGroups: [m3stack.io]
  resources: [m3deployments/scale]
  verbs: [patch]
- apiGroups: [""]
  resources: [configmaps, services]
  verbs: [create, delete, get, list, patch, watch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [create, delete, get, list, patch, watch]
- apiGroups: [autoscaling]
  resources: [horizontalpodautoscalers]
  verbs: [create, delete, get, list, patch, watch]
- apiGroups: [keda.sh]
  resources: [scaledobjects]
  verbs: [create, delete, get, list, patch, watch]
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [create, delete, get, list, patch, watch]
- apiGroups: [monitoring.coreos.com]
  resources: [servicemonitors]
  verbs: [create, delete, get, list, patch, watch]
- apiGroups: [networking.k8s.io]
  resources: [ingresses, networkpolicies]
  verbs: [create, delete, get, list, patch, watch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [create, delete, get, list, patch, watch]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}

{{/* kopf watches CRDs (is the CRD installed?) and namespaces (to resolve the watched ones): the only
     cluster-wide reads. */}}
{{- define "m3stack.clusterRules" -}}
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- end -}}

{{/* The operator's --gateway-* flags from gatewayDefaults (operator/cli.py): only the values that are set, so
an empty one leaves the gateway's own default. Whole numbers print as integers (YAML numbers reach templates
as float64, which print in exponent form above 1e6). */}}
{{- define "m3stack.gatewayDefaultFlags" -}}
{{- $defaults := .Values.gatewayDefaults -}}
{{- with $defaults.thinkingMode }}
- --gateway-thinking-mode={{ . }}
{{- end }}
{{- $numbers := dict
  "rate-limit-rps" (dig "rateLimits" "requestsPerSecond" nil $defaults)
  "rate-limit-tpm" (dig "rateLimits" "tokensPerMinute" nil $defaults)
  "rate-limit-concurrency" (dig "rateLimits" "concurrentRequests" nil $defaults)
  "max-request-bytes" (dig "limits" "maxRequestBytes" nil $defaults)
  "max-request-prompts" (dig "limits" "maxRequestPrompts" nil $defaults)
  "max-request-sequences" (dig "limits" "maxRequestSequences" nil $defaults) }}
{{- range $flag, $value := $numbers }}
{{- if not (kindIs "invalid" $value) }}
- --gateway-{{ $flag }}={{ if eq (float64 $value) (floor $value) }}{{ int64 $value }}{{ else }}{{ $value }}{{ end }}
{{- end }}
{{- end }}
{{- end -}}
