"""Grafana dashboards (JSON, provisioning) and the tool that renders their panels from Prometheus."""
