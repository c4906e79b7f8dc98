from django.urls import path

from example import views

urlpatterns = [
    path("api/hello", views.hello),
    path("limited", views.limited),
    path("health", views.health),
]
