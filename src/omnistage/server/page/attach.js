// An image for the next turn: chosen with the Attach button (a file input), sent at once (or at Start) as a
// user item with an input_image part (a data: URL), shown as a chip until a response has used it; the chip's
// button takes it back (conversation.item.delete). Only images: the model's realtime path takes images, and
// speech from the microphone.
"use strict";
let attached = null;  // { name, url, id, sent }

function attachFile(file) {
  $("attach-note").textContent = "";
  if (!file) return;
  if (!file.type.startsWith("image/")) {
    $("file").value = "";
    $("attach-note").textContent = `${file.name} is not an image: only images can be attached `
      + "(the model's realtime path takes images; speak for audio).";
    return;
  }
  const reader = new FileReader();
  reader.onload = () => {
    unattach();
    attached = { name: file.name, url: reader.result, sent: false,
                 id: "item_img" + Math.random().toString(36).slice(2, 14) };
    $("chip-name").textContent = file.name;
    $("chip").hidden = false;
    sendAttached();
  };
  reader.onerror = () => fail(`cannot read ${file.name}`);
  reader.readAsDataURL(file);
}

function sendAttached() {
  if (!attached || attached.sent || !ws || ws.readyState !== WebSocket.OPEN) return;
  attached.sent = true;
  send({ type: "conversation.item.create", event_id: "evt_" + attached.id, item: { id: attached.id,
    type: "message", role: "user", content: [{ type: "input_image", image_url: attached.url }] } });
}

function onSession() {  // a new session (Start): a new conversation, the image not in it yet
  if (attached) attached.sent = false;
  sendAttached();
}

function unattach() {  // the chip's button: the image is not for the next turn after all
  if (attached?.sent) {
    send({ type: "conversation.item.delete", item_id: attached.id });
    entries.get(attached.id)?.remove();
  }
  used();
}

function used() { attached = null; $("chip").hidden = true; $("file").value = ""; }

listeners.push((e) => {
  if (!attached) return;
  if (e.type === "conversation.item.done" && e.item.id === attached.id) {
    omni.images.push(e.item.id);
    say(`(image: ${attached.name})`, "user image", e.item.id);
  } else if (e.type === "error" && e.error.event_id === "evt_" + attached.id) {
    used();  // refused (app.js shows why)
  } else if (e.type === "response.created" && omni.images.includes(attached.id)) {
    used();
  }
});
$("attach").onclick = () => $("file").click();
$("file").onchange = () => attachFile($("file").files[0]);
$("unattach").onclick = unattach;
