{{- define "alignflow.fullname" -}}
{{- printf "%s-alignflow" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "alignflow.labels" -}}
app.kubernetes.io/name: alignflow
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "alignflow.selector" -}}
app.kubernetes.io/name: alignflow
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "alignflow.serviceAccountName" -}}
{{- default (include "alignflow.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "alignflow.image" -}}
{{- printf "%s/%s:%s" .root.Values.image.registry .name .root.Values.image.tag -}}
{{- end -}}

{{- define "alignflow.mlflowUrl" -}}
{{- printf "http://%s-mlflow:%v" (include "alignflow.fullname" .) .Values.mlflow.port -}}
{{- end -}}

{{- define "alignflow.s3Endpoint" -}}
{{- if .Values.secrets.s3.endpointUrl -}}{{ .Values.secrets.s3.endpointUrl }}
{{- else if .Values.seaweedfs.enabled -}}{{ printf "http://%s-seaweedfs:%v" (include "alignflow.fullname" .) .Values.seaweedfs.s3Port }}
{{- end -}}
{{- end -}}

{{/* Pod-level security: a fixed non-root uid, RuntimeDefault seccomp. */}}
{{- define "alignflow.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.runAsUser }}
runAsGroup: {{ .Values.runAsUser }}
fsGroup: {{ .Values.runAsUser }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Container-level security: read-only root, no privilege escalation, no capabilities. */}}
{{- define "alignflow.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{- define "alignflow.placement" -}}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.image.pullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* AWS_* variables from the S3 Secret. */}}
{{- define "alignflow.s3Env" -}}
- name: AWS_ACCESS_KEY_ID
  valueFrom: {secretKeyRef: {name: {{ .Values.secrets.s3.name }}, key: AWS_ACCESS_KEY_ID}}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom: {secretKeyRef: {name: {{ .Values.secrets.s3.name }}, key: AWS_SECRET_ACCESS_KEY}}
- name: AWS_ENDPOINT_URL
  valueFrom: {secretKeyRef: {name: {{ .Values.secrets.s3.name }}, key: AWS_ENDPOINT_URL, optional: true}}
- name: MLFLOW_S3_ENDPOINT_URL
  valueFrom: {secretKeyRef: {name: {{ .Values.secrets.s3.name }}, key: AWS_ENDPOINT_URL, optional: true}}
{{- end -}}

{{/* The Secret holding the MLflow admin's MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD. */}}
{{- define "alignflow.mlflowAuthSecret" -}}
{{- default (include "alignflow.mlflowChartAuthSecret" .) .Values.mlflow.auth.existingSecret -}}
{{- end -}}

{{/* The chart's own MLflow auth Secret (the Flask session key, and the admin unless existingSecret). */}}
{{- define "alignflow.mlflowChartAuthSecret" -}}
{{- printf "%s-mlflow-auth" (include "alignflow.fullname" .) -}}
{{- end -}}

{{/* A random value kept in the chart's auth Secret under .key: the one already in the cluster (so
upgrades keep it), else 32 new random characters. Computed once per render, so every template that
includes it gets the same one. */}}
{{- define "alignflow.generated" -}}
{{- $cache := .root.Values.mlflow.auth -}}
{{- $slot := printf "generated%s" .key -}}
{{- if not (hasKey $cache $slot) -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace (include "alignflow.mlflowChartAuthSecret" .root) -}}
{{- $old := dig "data" .key "" ($existing | default dict) -}}
{{- $_ := set $cache $slot (ternary (b64dec $old) (randAlphaNum 32) (ne $old "")) -}}
{{- end -}}
{{- get $cache $slot -}}
{{- end -}}

{{/* The MLflow admin password when the chart keeps it: mlflow.auth.adminPassword, else generated once
(MLflow sets the admin password only on its first start, so it must not change on upgrades). */}}
{{- define "alignflow.mlflowAdminPassword" -}}
{{- $auth := .Values.mlflow.auth -}}
{{- if $auth.adminPassword -}}
{{- if lt (len $auth.adminPassword) 12 -}}
{{- fail "mlflow.auth.adminPassword must be at least 12 characters (MLflow's rule); leave it empty to generate one" -}}
{{- end -}}
{{- $auth.adminPassword -}}
{{- else -}}
{{- include "alignflow.generated" (dict "root" . "key" "MLFLOW_TRACKING_PASSWORD") -}}
{{- end -}}
{{- end -}}

{{/* Host headers MLflow answers: its Service names, with and without the port, localhost, and extras. */}}
{{- define "alignflow.mlflowAllowedHosts" -}}
{{- $svc := printf "%s-mlflow" (include "alignflow.fullname" .) -}}
{{- $hosts := list -}}
{{- range $name := list $svc (printf "%s.%s" $svc .Release.Namespace) (printf "%s.%s.svc" $svc .Release.Namespace) (printf "%s.%s.svc.cluster.local" $svc .Release.Namespace) -}}
{{- $hosts = append (append $hosts $name) (printf "%s:%v" $name $.Values.mlflow.port) -}}
{{- end -}}
{{- $hosts = concat $hosts (list "localhost" "localhost:*" "127.0.0.1" "127.0.0.1:*") .Values.mlflow.extraAllowedHosts -}}
{{- if has "*" $hosts -}}
{{- fail "mlflow.extraAllowedHosts must not contain \"*\": list the host names clients use" -}}
{{- end -}}
{{- join "," $hosts -}}
{{- end -}}

{{/* Peers admitted to the chart's servers: labelled clients (and KFP component pods) here and in allowNamespaces. */}}
{{- define "alignflow.clientPeers" -}}
{{- $np := .Values.networkPolicy -}}
{{- $selectors := list (dict $np.clientLabel "true") -}}
{{- if $np.allowKfpComponents -}}
{{- $selectors = append $selectors (dict "pipelines.kubeflow.org/v2_component" "true") -}}
{{- end -}}
{{- range $selectors }}
- podSelector:
    matchLabels:
      {{- toYaml . | nindent 6 }}
{{- end }}
{{- range $ns := $np.allowNamespaces }}
{{- range $selectors }}
- namespaceSelector:
    matchLabels:
      kubernetes.io/metadata.name: {{ $ns }}
  podSelector:
    matchLabels:
      {{- toYaml . | nindent 6 }}
{{- end }}
{{- end }}
{{- end -}}
