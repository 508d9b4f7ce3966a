# One image for the gateway and the ASR worker; docker-compose.yml picks the command.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app

COPY pyproject.toml README.md ./
COPY cosyvoice ./cosyvoice
# resemblyzer (speaker labels) without its declared typing backport and webrtcvad C build:
# pyproject.toml lists what it needs (docs/speakers.md)
RUN pip install . && pip install --no-deps resemblyzer==0.1.4
COPY gunicorn.conf.py worker.py ./

RUN useradd --system --uid 10001 --home-dir /app cosyvoice
USER cosyvoice

EXPOSE 8000
CMD ["gunicorn", "-c", "gunicorn.conf.py", "cosyvoice.webui:app"]
