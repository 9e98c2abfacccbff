{{/*
Names, labels and the operator's RBAC rules, shared by every template.
*/}}

{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every object name: the release name, suffixed with the chart name unless it
already contains it. Kept to 46 characters so "-operator-metrics" still fits in 63.
*/}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 46 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 46 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 46 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "tandem.operatorName" -}}
{{- printf "%s-operator" (include "tandem.fullname" .) }}
{{- end }}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels on every object of the chart. The operator's own objects are component "operator";
the pods it creates for InferencePools are prefill, decode or router, so selectors never mix.
*/}}
{{- define "tandem.labels" -}}
helm.sh/chart: {{ include "tandem.chart" . }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tandem
{{- end }}

{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tandem.operatorName" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tandem.peeringName" -}}
{{- default (include "tandem.fullname" .) .Values.peering.name }}
{{- end }}

{{/* "true" when the operator serves every namespace (watchNamespaces is empty). */}}
{{- define "tandem.clusterWide" -}}
{{- if empty .Values.watchNamespaces }}true{{ end }}
{{- end }}

{{/*
What the operator does inside a namespace it serves, and nothing more: reconcile
InferencePools (kopf patches them for finalizers and progress, and writes status), run their
pods, and create the Services, Secret, PDBs, router RBAC, NetworkPolicies and PodMonitors
(spec.monitoring) it owns.
Creating the router's Role needs the operator to hold the pod read permissions that Role
grants (it does).
Secrets have their own rule with only what the operator does to its one Secret per pool
(<pool>-admin-token): create it, patch in missing keys, and get/list/watch it (kopf's watch,
filtered by the tandem.dev/pool label, keeps a steady pool at zero API calls). No update or
delete: garbage collection removes the Secret with its pool. RBAC cannot filter by label, so
with an empty watchNamespaces these reads reach every namespace's Secrets; watchNamespaces
confines them to the namespaces listed (charts/tandem/README.md).
*/}}
{{- define "tandem.namespacedRules" -}}
- apiGroups: [tandem.dev]
  resources: [inferencepools]
  verbs: [get, list, watch, patch, update]
- apiGroups: [tandem.dev]
  resources: [inferencepools/status]
  verbs: [get, patch, update]
- apiGroups: [tandem.dev]
  resources: [inferencepools/finalizers]
  verbs: [update]
- apiGroups: [""]
  resources: [pods]
  verbs: [create, delete, get, list, watch, patch]
- apiGroups: [""]
  resources: [pods/status]
  verbs: [get]
- apiGroups: [""]
  resources: [services, serviceaccounts]
  verbs: [create, get, list, watch, patch, update, delete]
- apiGroups: [""]
  resources: [secrets]
  verbs: [create, get, list, watch, patch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [create, get, list, watch, patch, update, delete]
- apiGroups: [apps]
  resources: [controllerrevisions]
  verbs: [create, get, list, watch, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [create, get, list, watch, patch, update, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [create, get, list, watch, patch, update, delete]
- apiGroups: [monitoring.coreos.com]
  resources: [podmonitors]
  verbs: [create, get, patch, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
{{- end }}

{{/* kopf watches CRDs to discover the resources it serves. */}}
{{- define "tandem.scanningRules" -}}
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [get, list, watch]
{{- end }}

{{/*
The two images, <registry>/<repository>:<tag or appVersion>: the operator's, and the engines'
that the operator gives pools without spec.engine.image. `make images` builds the same names.
*/}}
{{- define "tandem.operatorImage" -}}
{{ .Values.registry }}/{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "tandem.engineImage" -}}
{{ .Values.registry }}/{{ .Values.engineImage.repository }}:{{ .Values.engineImage.tag | default .Chart.AppVersion }}
{{- end }}
