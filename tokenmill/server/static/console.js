// The console's entry point: the key prompt, the page switcher and the live feed.
import { Api, ApiError, readEvents } from "./api.js";
import { Dashboard } from "./dashboard.js";
import { Playground } from "./playground.js";

// The live feed: reconnects after a failure, asks for the key on a 401.
class Feed {
  constructor(api, onSnapshot, onState) {
    this.api = api;
    this.onSnapshot = onSnapshot;
    this.onState = onState;
    this.controller = null;
  }

  start() {
    if (this.controller) return;
    this.controller = new AbortController();
    this.loop(this.controller.signal);
  }

  stop() {
    if (this.controller) this.controller.abort();
    this.controller = null;
  }

  async loop(signal) {
    while (!signal.aborted) {
      try {
        const response = await this.api.fetch("/v1/stats/stream", { signal });
        if (!response.ok) throw await ApiError.from(response);
        // "live" only once a snapshot is on the page, not when the headers arrive.
        let shown = false;
        await readEvents(response, (event) => {
          this.onSnapshot(event);
          if (!shown) { shown = true; this.onState("live"); }
        });
        this.onState("reconnecting…");
      } catch (error) {
        if (signal.aborted) return;
        if (error.status === 401) { this.controller = null; this.onState("needs API key"); return; }
        this.onState("offline — retrying");
      }
      await new Promise((resolve) => setTimeout(resolve, 2000));
    }
  }
}

function askForKey(api, onKey) {
  const dialog = document.getElementById("key-dialog");
  const form = document.getElementById("key-form");
  const input = document.getElementById("key-input");
  const error = document.getElementById("key-error");
  if (dialog.open) return;
  error.hidden = !api.key;
  error.textContent = api.key ? "That key was refused." : "";
  form.onsubmit = async (event) => {
    event.preventDefault();
    const key = input.value.trim();
    if (!key) return;
    const probe = await fetch("/v1/models", { headers: { Authorization: `Bearer ${key}` }, cache: "no-store" });
    if (probe.status === 401) {
      error.hidden = false;
      error.textContent = "That key was refused.";
      return;
    }
    api.setKey(key);
    input.value = "";
    dialog.close();
    onKey();
  };
  dialog.showModal();
  input.focus();
}

function showPage(name) {
  for (const page of document.querySelectorAll(".page")) page.hidden = page.id !== name;
  for (const tab of document.querySelectorAll("nav a")) tab.classList.toggle("active", tab.id === `tab-${name}`);
}

function main() {
  const api = new Api();
  const dashboard = new Dashboard();
  const playground = new Playground(api);
  const connection = document.getElementById("connection");
  const feed = new Feed(api, (snapshot) => {
    dashboard.update(snapshot);
    document.getElementById("model-name").textContent = snapshot.model || "";
  }, (state) => {
    connection.textContent = state;
    connection.classList.toggle("live", state === "live");
  });
  api.onUnauthorized = () => askForKey(api, () => feed.start());
  const route = () => showPage(location.hash === "#playground" ? "playground" : "dashboard");
  window.addEventListener("hashchange", route);
  route();
  feed.start();
}

document.addEventListener("DOMContentLoaded", main);
