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
