#!/bin/sh
# Renders deploy/nginx.conf to stdout: substitutes the NGINX_* variables it documents
# and nothing else (nginx's own $variables stay). Fails if one of them is unset.
#
#   NGINX_USER=www-data NGINX_HTTP_PORT=80 NGINX_HTTPS_PORT=443 \
#   NGINX_SERVER_NAME=speech.example.com \
#   NGINX_TLS_CERT=/etc/letsencrypt/live/speech.example.com/fullchain.pem \
#   NGINX_TLS_KEY=/etc/letsencrypt/live/speech.example.com/privkey.pem \
#   NGINX_UPSTREAMS='server 10.0.0.11:8000; server 10.0.0.12:8000;' \
#   NGINX_LOG_DIR=/var/log/nginx \
#   sh deploy/render-nginx.sh > /etc/nginx/nginx.conf && nginx -t && nginx -s reload
set -eu
: "${NGINX_USER:?}" "${NGINX_HTTP_PORT:?}" "${NGINX_HTTPS_PORT:?}" "${NGINX_SERVER_NAME:?}"
: "${NGINX_TLS_CERT:?}" "${NGINX_TLS_KEY:?}" "${NGINX_UPSTREAMS:?}" "${NGINX_LOG_DIR:?}"
exec envsubst '${NGINX_USER} ${NGINX_HTTP_PORT} ${NGINX_HTTPS_PORT} ${NGINX_SERVER_NAME} ${NGINX_TLS_CERT} ${NGINX_TLS_KEY} ${NGINX_UPSTREAMS} ${NGINX_LOG_DIR}' < "$(dirname "$0")/nginx.conf"
