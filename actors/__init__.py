"""Ray actors and deployments wrapping the plain classes of capture/, trainer/ and serving/."""
