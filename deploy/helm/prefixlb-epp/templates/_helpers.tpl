{{/* The picker's name: the release's, e.g. prefixlb-epp. */}}
{{- define "epp.name" -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The shared state's URL ("" for none). */}}
{{- define "epp.redisURL" -}}
{{- if .Values.redis.url -}}
{{- .Values.redis.url -}}
{{- else if .Values.redis.enabled -}}
redis://{{ include "epp.name" . }}-redis:6379/0
{{- end -}}
{{- end -}}
