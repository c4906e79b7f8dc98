from django.conf import settings
from django.urls import path

from example import views

urlpatterns = [
    path("api/hello", views.hello),
    path("limited", views.limited),
    path("health", views.health),
]

if settings.DRF:
    from example import api

    urlpatterns += [
        path("drf/hello", api.Hello.as_view()),
        path("drf/hello-drf-cache", api.HelloDrfCache.as_view()),
    ]
