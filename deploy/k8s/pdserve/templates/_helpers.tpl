{{/*
Helpers shared by every template. Label scheme (docs/design.md §2, reference §4.2):
every pod carries app.kubernetes.io/{name,instance} and pdserve.io/role: router|prefill|decode;
selectors use exactly pdserve.selectorLabels, so a Service, PDB or ScaledObject of one role
can never pick up pods of another role or another release.

Helpers that need a role take a dict: (dict "ctx" $ "role" "prefill").
*/}}

{{/* The chart name, overridable. */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The release-scoped base name of every object. Truncated to 48 characters so that
"<fullname>-router-control" (the longest suffix, 15 characters) still fits the 63-character
DNS label limit.
*/}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 48 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 48 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* chart-version for the helm.sh/chart label. */}}
{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The served model id as a label value: config.model.name, else the last component of
config.model.path (what the router itself does), with characters labels do not allow
("meta-llama/Llama-3.1-8B" has a slash) replaced by "-".
*/}}
{{- define "pdserve.modelLabel" -}}
{{- $name := .Values.config.model.name | default (base .Values.config.model.path) }}
{{- regexReplaceAll "[^A-Za-z0-9_.-]" $name "-" | trunc 63 | trimAll "-_." }}
{{- end }}

{{/* Selector labels of one role: the only labels selectors may use. Takes (dict "ctx" "role"). */}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
pdserve.io/role: {{ .role }}
{{- end }}

{{/* All labels of one role's objects and pods: the selector labels plus descriptive ones. */}}
{{- define "pdserve.labels" -}}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/component: {{ .role }}
{{ include "pdserve.sharedLabels" .ctx }}
{{- end }}

{{/* Labels of objects that belong to the whole release (ConfigMap, ServiceAccount). */}}
{{- define "pdserve.releaseLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{ include "pdserve.sharedLabels" . }}
{{- end }}

{{/* Descriptive labels every object carries. Takes the root context. */}}
{{- define "pdserve.sharedLabels" -}}
app.kubernetes.io/part-of: pdserve
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | trunc 63 | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ include "pdserve.chart" . }}
pdserve.io/model: {{ include "pdserve.modelLabel" . | quote }}
{{- end }}

{{/* The container image reference. */}}
{{- define "pdserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* The ServiceAccount the pods run as. */}}
{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The ConfigMap (or Secret) holding cluster.yaml. */}}
{{- define "pdserve.configName" -}}
{{- printf "%s-config" (include "pdserve.fullname" .) }}
{{- end }}

{{/*
host:port the workers dial to register (--router). The control Service is headless: the name
resolves to every router pod and each worker registers with all of them (it resolves the name
again every 10 s). It publishes not-ready router pods: a router only turns ready once a decode
worker registered, and the workers must reach it before that.
*/}}
{{- define "pdserve.routerControlAddress" -}}
{{- printf "%s-router-control.%s.svc:%v" (include "pdserve.fullname" .) .Release.Namespace .Values.config.router.workers.control_port }}
{{- end }}

{{/*
Pod annotation that rolls every pod when the cluster YAML changes (the processes read it
once, at start).
*/}}
{{- define "pdserve.configChecksum" -}}
checksum/config: {{ toYaml .Values.config | sha256sum }}
{{- end }}

{{/*
Prometheus label matchers that scope a KEDA query to this release: the labels a
ServiceMonitor-scraped series carries (namespace, service), plus extra matchers from values.
Takes (dict "ctx" "role").
*/}}
{{- define "pdserve.promMatchers" -}}
{{- $m := printf "namespace=\"%s\",service=\"%s-%s\"" .ctx.Release.Namespace (include "pdserve.fullname" .ctx) .role }}
{{- with .ctx.Values.autoscaling.keda.extraMatchers }}
{{- $m = printf "%s,%s" $m . }}
{{- end }}
{{- $m }}
{{- end }}

{{/*
Volumes shared by the worker pods: the cluster YAML, the model (PVC or hostPath, read-only,
never downloaded at runtime) and /dev/shm in memory (NCCL and UCX shared-memory transports).
Takes (dict "ctx" "shmSize").
*/}}
{{- define "pdserve.workerVolumes" -}}
- name: config
  {{- include "pdserve.configVolumeSource" .ctx | nindent 2 }}
{{- include "pdserve.clusterSecretVolume" .ctx }}
- name: model
  {{- include "pdserve.modelVolumeSource" .ctx | nindent 2 }}
- name: dshm
  emptyDir:
    medium: Memory
    {{- with .shmSize }}
    sizeLimit: {{ . }}
    {{- end }}
{{- end }}

{{/* The cluster secret's name: the user's existing Secret, or the one the chart makes. */}}
{{- define "pdserve.clusterSecretName" -}}
{{- .Values.clusterSecret.existingSecret | default (printf "%s-cluster-secret" (include "pdserve.fullname" .)) }}
{{- end }}

{{/* The cluster secret volume (mode 0400: the processes refuse a secret others can read). */}}
{{- define "pdserve.clusterSecretVolume" -}}
{{- if .Values.clusterSecret.enabled }}
- name: cluster-secret
  secret:
    secretName: {{ include "pdserve.clusterSecretName" . }}
    defaultMode: 256
    items:
      - key: {{ .Values.clusterSecret.key }}
        path: {{ .Values.clusterSecret.key }}
{{- end }}
{{- end }}

{{/* The cluster YAML as rendered: .Values.config plus cluster.secret_file when the chart mounts the secret. */}}
{{- define "pdserve.renderedConfig" -}}
{{- $cfg := deepCopy .Values.config }}
{{- if .Values.clusterSecret.enabled }}
{{- $_ := set $cfg "cluster" (dict "secret_file" (printf "/etc/pdserve-secret/%s" .Values.clusterSecret.key)) }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{/* The volume source of cluster.yaml: a ConfigMap, or a Secret when it holds API keys. */}}
{{- define "pdserve.configVolumeSource" -}}
{{- if .Values.clusterConfig.asSecret -}}
secret:
  secretName: {{ include "pdserve.configName" . }}
{{- else -}}
configMap:
  name: {{ include "pdserve.configName" . }}
{{- end }}
{{- end }}

{{/* The volume source of the model directory. */}}
{{- define "pdserve.modelVolumeSource" -}}
{{- if and (eq .Values.modelVolume.type "pvc") (not .Values.modelVolume.pvc.claimName) }}
{{- fail "modelVolume.pvc.claimName is required when modelVolume.type is pvc (a ReadOnlyMany/ReadWriteMany claim holding the model directory)" }}
{{- end }}
{{- if and (eq .Values.modelVolume.type "hostPath") (not .Values.modelVolume.hostPath.path) }}
{{- fail "modelVolume.hostPath.path is required when modelVolume.type is hostPath (the directory on every node that holds the model)" }}
{{- end }}
{{- if eq .Values.modelVolume.type "pvc" -}}
persistentVolumeClaim:
  claimName: {{ .Values.modelVolume.pvc.claimName }}
  readOnly: true
{{- else if eq .Values.modelVolume.type "hostPath" -}}
hostPath:
  path: {{ .Values.modelVolume.hostPath.path }}
  type: {{ .Values.modelVolume.hostPath.type }}
{{- else }}
{{- fail (printf "modelVolume.type: %q is not one of pvc, hostPath" .Values.modelVolume.type) }}
{{- end }}
{{- end }}

{{/* Mounts of the config and model volumes (router and workers). */}}
{{- define "pdserve.commonMounts" -}}
- name: config
  mountPath: /etc/pdserve
  readOnly: true
{{- if .Values.clusterSecret.enabled }}
- name: cluster-secret
  mountPath: /etc/pdserve-secret
  readOnly: true
{{- end }}
- name: model
  mountPath: {{ .Values.modelVolume.mountPath }}
  readOnly: true
{{- end }}

{{/*
Environment of every worker: its identity from the downward API (pod name -> --id, pod IP ->
--advertise-host) and the UCX knobs when set.
*/}}
{{- define "pdserve.workerEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- with .Values.ucx.tls }}
- name: UCX_TLS
  value: {{ . | quote }}
{{- end }}
{{- with .Values.ucx.netDevices }}
- name: UCX_NET_DEVICES
  value: {{ . | quote }}
{{- end }}
{{- range $k, $v := .Values.ucx.extraEnv }}
- name: {{ $k }}
  value: {{ $v | quote }}
{{- end }}
{{- end }}

{{/*
Resources of a worker container: the values' requests/limits, plus the GPUs (equal in
requests and limits, as the device plugin requires) and the RDMA device-plugin slot when
enabled. Takes (dict "ctx" "pool"), pool being .Values.prefill or .Values.decode.
*/}}
{{- define "pdserve.workerResources" -}}
{{- $ctx := .ctx }}
{{- $requests := deepCopy (.pool.resources.requests | default dict) }}
{{- $limits := deepCopy (.pool.resources.limits | default dict) }}
{{- if gt (int .pool.gpus) 0 }}
{{- $_ := set $requests $ctx.Values.gpu.resourceName (int .pool.gpus | toString) }}
{{- $_ := set $limits $ctx.Values.gpu.resourceName (int .pool.gpus | toString) }}
{{- end }}
{{- if $ctx.Values.rdma.enabled }}
{{- $_ := set $requests $ctx.Values.rdma.resourceName (int $ctx.Values.rdma.count | toString) }}
{{- $_ := set $limits $ctx.Values.rdma.resourceName (int $ctx.Values.rdma.count | toString) }}
{{- end }}
{{- $res := dict }}
{{- with $requests }}
{{- $_ := set $res "requests" . }}
{{- end }}
{{- with $limits }}
{{- $_ := set $res "limits" . }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/*
Container securityContext of a worker: IPC_LOCK for RDMA memory registration. Kubernetes has
no ambient capabilities, so an added capability only takes effect for uid 0: with RDMA on,
the worker runs as root unless rdma.runAsRoot is false (then the node must raise
RLIMIT_MEMLOCK for containers instead). Takes the root context.
*/}}
{{- define "pdserve.workerSecurityContext" -}}
{{- $sc := deepCopy (.Values.workerSecurityContext | default dict) }}
{{- if .Values.rdma.enabled }}
{{- $caps := deepCopy (get $sc "capabilities" | default dict) }}
{{- $add := get $caps "add" | default list }}
{{- if not (has "IPC_LOCK" $add) }}
{{- $add = append $add "IPC_LOCK" }}
{{- end }}
{{- $_ := set $caps "add" $add }}
{{- $_ := set $sc "capabilities" $caps }}
{{- if .Values.rdma.runAsRoot }}
{{- $_ := set $sc "runAsUser" 0 }}
{{- $_ := set $sc "runAsNonRoot" false }}
{{- end }}
{{- end }}
{{- with $sc }}
{{- toYaml . }}
{{- end }}
{{- end }}

{{/*
Pod annotations of a worker: the config checksum, the Multus network(s) when enabled, and the
pool's own. Takes (dict "ctx" "pool").
*/}}
{{- define "pdserve.workerPodAnnotations" -}}
{{ include "pdserve.configChecksum" .ctx }}
{{- if .ctx.Values.multus.enabled }}
k8s.v1.cni.cncf.io/networks: {{ required "multus.networks is required when multus.enabled (e.g. \"rdma/ib-net\", namespace/NetworkAttachmentDefinition)" .ctx.Values.multus.networks | quote }}
{{- end }}
{{- with .pool.podAnnotations }}
{{ toYaml . }}
{{- end }}
{{- end }}
